"""Issue 39, batch 1: the Qwen3-30B-A3B-shaped MoE decode step (48 layers, CUDA graphs, context
512) before and after the batch-1 latency work, side by side in one process.

`python -m benchmarks.moe_b1_bench --out DIR` (benchmarks/run_moe_b1_device.sh calls it) writes
DIR/moe_b1.json and DIR/MOE_B1.md and ends its stdout with a compact summary:

1. ceilings: device-to-device copy bandwidth (the roofline's denominator).
2. attention: the decode split kernel alone as the step runs it at batch 1 (fused rotary + cache
   store, 32 query heads over 4 KV heads, head_dim 128, context 512: 1 MB of K/V a layer), 48
   distinct layers' caches replayed back to back in one CUDA graph, for the kernel's default
   tiling and a grid of split counts x tiles x warps (CudaAttentionBackend.few_program_decode's
   fields): us per layer each, the best first.
3. model: the whole model (48 layers built by the shard's loader from an 8-layer random
   checkpoint's layers, benchmarks/moe_bench.aliased_layers), bf16 and then --quantize fp8, decode
   at batch 1 in a CUDA graph per variant:
   - `old`: the MoE half as on main: add + RMSNorm, router GEMV, routing launch, gate/up,
     down+sum (shard.layers.moe.fused_router(False));
   - `fused`: add + RMSNorm + router GEMV + routing in one launch (shard/kernels/moe_router.py);
   - `fused+attn:<tiling>`: also the attention sweep's best tiling (when it beats the default)
     and a few split counts, set as the backend's few_program_decode;
   - `fused+norm-prologue[+attn:<tiling>]`: also the input add + RMSNorm inside the qkv GEMV's
     launch (shard/kernels/norm_gemv.py, opt-in shard.layers.linear.norm_prologue);
   - `fused:router-r<rows>w<warps>`: other tilings of the fused launch (moe_router.RouterConfig);
   - `old:up-stream[-<tiling>]` (CUDA only, bf16 and fp8): `old` with the persistent gate/up
     launch (moe_decode.DecodeConfig.up_stream, UP_STREAMS: tilings, programs per SM);
   - `old:no-router-norm` (CUDA only): `old` with the post-attention add + RMSNorm as its own
     launch (shard.layers.moe.ROUTER_NORM off; on, the default since round 17, add + RMSNorm +
     router GEMV are one launch and the routing its own);
   - ROUND17_CONFIGS (CUDA only): the decode table's entry with route_trigger, route_dependent,
     down_early_ids or the split down launch switched (moe_decode.DecodeConfig);
   - ROUND19_CONFIGS (CUDA only): the expert launches' pipelines, K tiles and program counts;
   - `old:block-merge` (CUDA only): `old` with the decode attention's split merge as one block
     (attention_decode.merge_by_split off; on, the default since round 18);
   - `old:no-short-graph` (CUDA only): `old` without the second graph made for contexts up to
     512 positions with 32-position K/V tiles (CudaAttentionBackend.short_decode; on, the
     default since round 20);
   fp8 runs the old step's variants, fused, fused+norm-prologue and the first attention tiling
   only (time);
   each with the step's byte roofline (moe_bench._step_bytes: dense weights and norms, LM head,
   the experts the step touched by the layers' own routing statistics, K/V) and a per-kernel
   breakdown (device us per step and per layer, by kernel name, CUPTI; `--no-profile` skips it,
   and step-time A/Bs should: a CUPTI session slows the process's later graph replays).
   `--stamps`: each variant's stamped launches' phases inside the step (step_stamps).

`--tiny` runs part 3's code path on CPU with a small shape (eager steps, no graphs, no sweep).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import json
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.harness.kernel_profile import device_spans, exposed_by_kernel, label_by_neighbours
from benchmarks.moe_bench import (
    QWEN3_30B_A3B,
    TINY,
    _expert_bytes,
    _step_bytes,
    aliased_layers,
    link_model,
    part_runner,
    write_checkpoint,
)

CONTEXT = 512
LAYERS = 48
STORED = 8  # layers in the random checkpoint; the rest alias them
# Attention sweep: split counts x K/V tile x warps (stages: the kernel's default 3). Each
# (tile, warps, next_pow2(splits)) is a compile of its own (~2-4 s): 2 warps only with tile 16.
SPLITS = (4, 8, 16, 32)
TILES = (16, 32, 64)
WARPS = (4, 2, 1)
# Split counts also tried in the whole model (with the default tile), beside the sweep's best.
MODEL_SPLITS = (8,)
# (splits, K/V tile, warps, stages) of the attention launch run in the default step
# (old+attn:...); round 18: one stage, and 32-position tiles with four warps
# (benchmarks/attention_stamps.py: the fastest alone)
OLD_ATTN_TILINGS = ((16, 16, 2, 3), (16, 32, 2, 3), (16, 32, 1, 3), (32, 16, 1, 3),
                    (8, 64, 2, 3), (16, 64, 4, 1), (16, 32, 4, 3))


# ---- 2. attention kernel alone -------------------------------------------------------------


def attention_chain(shape: dict, layers: int = LAYERS, context: int = CONTEXT
                    ) -> Callable[..., None]:
    """run(tiling, fused=True, stamps=None): the batch-1 decode attention of `layers` distinct
    layers back to back (each its own K/V cache of `context` random positions and its own q/k/v),
    as a step launches it: fused rotary + store + split-KV (fused=False: q as if rotated, the
    cache as if written). tiling: a DecodeTiling or None (the defaults); stamps: None or int64
    [layers, programs, STAMP_SLOTS] (shard/kernels/stamps.py)."""
    import torch

    from shard.attention.cuda_backend import DecodeTiling
    from shard.kernels import attention_decode as ad
    from shard.layers.rotary import RotaryEmbedding

    heads, kvh, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    page = 16
    per = context // page
    dev = torch.device("cuda")
    rope = RotaryEmbedding(hd, context + 1, {"rope_type": "default", "rope_theta": 1e6}, dev)
    gen = torch.Generator(device="cuda").manual_seed(0)
    caches = [torch.randn(2, per + 1, page, kvh, hd, device=dev, generator=gen).bfloat16()
              for _ in range(layers)]
    qkv = torch.randn(layers, 1, (heads + 2 * kvh) * hd, device=dev, generator=gen).bfloat16()
    tables = torch.arange(per, dtype=torch.int32, device=dev)[None, :]
    lens = torch.tensor([context], dtype=torch.int32, device=dev)
    pos = torch.tensor([context - 1], device=dev)
    slots = torch.tensor([context - 1], device=dev)
    outs = torch.empty(layers, 1, heads, hd, dtype=torch.bfloat16, device=dev)

    def run(t: DecodeTiling | None, fused: bool = True, stamps: Any = None) -> None:
        for i in range(layers):
            q, k, v = qkv[i].split([heads * hd, kvh * hd, kvh * hd], -1)
            kw: dict[str, Any] = {"stamps": None if stamps is None else stamps[i]}
            if t is not None:
                kw.update(num_splits=t.num_splits, block_n=t.block_n, num_warps=t.num_warps,
                          num_stages=t.num_stages)
            if not fused:  # q taken as already rotated, the cache as already written
                ad.paged_decode_attention(q.view(1, heads, hd), caches[i][0], caches[i][1],
                                          tables, lens, hd**-0.5, out=outs[i], **kw)
                continue
            ad.rotary_store_decode_attention(
                q.view(1, heads, hd), k.view(1, kvh, hd), v.view(1, kvh, hd), pos, rope.cos,
                rope.sin, caches[i][0], caches[i][1], slots, tables, lens, hd**-0.5,
                out=outs[i], **kw)

    return run


def attention_sweep(shape: dict, layers: int = LAYERS, budget_s: float = 60.0) -> dict:
    """The fused rotary + store + split-KV decode kernel at batch 1, each tiling over `layers`
    distinct caches in one CUDA graph: us per layer."""
    import torch

    from benchmarks.moe_bench import _graph_ms
    from shard.attention.cuda_backend import DecodeTiling
    from shard.kernels import attention_decode as ad

    kvh, hd = shape["num_key_value_heads"], shape["head_dim"]
    run = attention_chain(shape, layers)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default_splits = ad.default_num_splits(1, kvh, sms)

    name = f"s{default_splits}-n{ad.decode_tile(hd)}-w4-st3"
    rows: list[dict] = [{"tiling": f"default({name})",
                         "us_per_layer": _graph_ms(lambda: run(None)) * 1e3 / layers}]
    # Where the default's time goes: without the rotary prologue and the new token's store
    # (q as if rotated: the cost of that prologue), and one split (no merge, no ticket; each
    # program streams its head's whole context: a candidate too)
    rows.append({"tiling": f"default({name}), no rotary prologue (reference only)",
                 "us_per_layer": _graph_ms(lambda: run(None, False)) * 1e3 / layers})
    one = DecodeTiling(kvh, 1, ad.decode_tile(hd))
    rows.append({"tiling": one.name(), "us_per_layer": _graph_ms(lambda: run(one)) * 1e3 / layers,
                 "splits": 1, "block_n": one.block_n, "num_warps": 4, "programs": kvh})
    t0 = time.perf_counter()
    for s in SPLITS:
        for n in TILES:
            for w in WARPS if n == min(TILES) else WARPS[:1]:
                t = DecodeTiling(kvh, s, n, w, 3)
                if time.perf_counter() - t0 > budget_s:  # compiles are the cost: keep the rest
                    rows.append({"tiling": t.name(), "error": "skipped: time budget"})
                    continue
                try:
                    us = _graph_ms(lambda t=t: run(t)) * 1e3 / layers
                except Exception as exc:  # noqa: BLE001 - a tiling that cannot compile
                    rows.append({"tiling": t.name(), "error": f"{type(exc).__name__}"[:80]})
                    continue
                rows.append({"tiling": t.name(), "us_per_layer": us, "splits": s, "block_n": n,
                             "num_warps": w, "programs": kvh * s,
                             "busy_splits": min(s, -(-CONTEXT // n))})
    ok = sorted((r for r in rows if "us_per_layer" in r), key=lambda r: r["us_per_layer"])
    return {"rows": ok + [r for r in rows if "error" in r], "default": rows[0],
            "best": next((r for r in ok if "splits" in r), None), "kv_bytes_per_layer":
            2 * CONTEXT * kvh * hd * 2, "default_splits": default_splits}


# ---- 3. whole model ------------------------------------------------------------------------


def kernel_table(fn, calls: int, layers: int) -> dict:
    """Device us per step by kernel name (CUPTI, graph replays included): [{name, us, count}],
    longest first, and the step's kernel count and sum."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t <= 0 or evt.count <= 0:
            continue
        name = evt.key[:70]
        us[name] += t / calls
        count[name] += evt.count // calls
    rows = [{"name": k, "us": v, "count": count[k], "us_per_layer": v / layers}
            for k, v in sorted(us.items(), key=lambda kv: -kv[1])]
    # The critical path by kernel (kernel_profile.exposed_by_kernel): what each adds to the step
    # after everything before it finished; idle = the host's gaps between the replays.
    charged, idle = exposed_by_kernel(label_by_neighbours(device_spans(prof), _short))
    exposed = [{"name": k, "us_per_layer": v / calls / layers}
               for k, v in sorted(charged.items(), key=lambda kv: -kv[1])]
    return {"kernels_per_step": sum(count.values()), "kernel_sum_us": sum(us.values()),
            "rows": rows, "exposed": exposed, "idle_us_per_step": idle / calls}


# Fused router launch tilings also tried in the bf16 model (rows per program, warps), beside
# moe_router.default_config's (4 rows, 4 warps at hidden 2048): one warp makes the last
# program's top-k a warp-shuffle reduction; fewer rows, more programs in flight.
ROUTER_CONFIGS = ((1, 1), (2, 2))


# The persistent gate/up launch (moe_decode.DecodeConfig.up_stream) in the old step: the table's
# batch-1 entry with its gate/up launch replaced, the down launch as it is. (variant, weight rows,
# K tile for bf16, K tile for fp8 (1-byte weights: twice the K for the same bytes), stages,
# programs per SM).
UP_STREAMS = (
    # branch moep's measured stream (318c99d: 50.3 MB in 17.3 us, 98 % of copy): 16 x 1024 bf16;
    # fp8 16 x 2048, the same 32 KB a tile
    ("old:up-stream", 16, 1024, 2048, 3, 1),
    # one K tile an item (an epilogue every tile), half the rows: twice the items, finer balance;
    # fp8: 16 KB tiles (H = 2048 is the widest K tile)
    ("old:up-stream-8x2048-st4", 8, 2048, 2048, 4, 1),
    # two programs an SM: twice the tiles in flight, half the items each
    ("old:up-stream-2sm", 16, 1024, 2048, 3, 2),
)


# moe_decode.DecodeConfig changes on the table's batch-1 entry measured in round 17
# (benchmarks/MOE_B1.md): (variant name, the fields replaced)
ROUND17_CONFIGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("old:route-trigger", {"route_trigger": True}),
    ("old:no-route-trigger", {"route_trigger": False}),
    ("old:down-early", {"down_early_ids": True}),
    ("old:no-down-early", {"down_early_ids": False}),
    ("old:route-trigger+down-early", {"route_trigger": True, "down_early_ids": True}),
    ("old:split16", {"down_split": 16, "down_block_k": 256, "down_stages": 3}),
    ("old:route-trigger+split16", {"route_trigger": True, "down_split": 16,
                                   "down_block_k": 256, "down_stages": 3}),
    ("old:route-dependent", {"route_dependent": True}),
    ("old:up-late", {"up_late_trigger": True}),
    ("old:route-trigger+up-late", {"route_trigger": True, "up_late_trigger": True}),
    # round 18: the routing's top-k as one bitonic top-k (the default since round 19); the loop
    ("old:route-sorted", {"route_sorted": True}),
    ("old:route-loop", {"route_sorted": False}),
)


# The expert launches' bytes in flight, round 19 (benchmarks/MOE_B1.md): the step stamps put
# bf16's gate/up at 77 % and its fused-sum down at 58 % of copy rate after their PDL waits, fp8's
# at 64 % and (split down) 42 %. (variant name, the fields replaced as a function of the
# table's batch-1 entry: deeper pipelines, wider K tiles, more down programs)
def _down_stages(t: Any) -> int:
    return t.down_stages or t.stages


ROUND19_CONFIGS: tuple[tuple[str, Callable[[Any], dict[str, Any]]], ...] = (
    ("old:down-st6", lambda t: {"down_stages": 6}),
    # one K tile an expert slice (768 of 1024; the split launch's 32 rows spill at 1024: 512)
    ("old:down-kwide", lambda t: {"down_block_k": 512 if t.down_split else 1024,
                                  "down_stages": 2}),
    ("old:down-n4", lambda t: {"down_block_n": 4, "down_stages": _down_stages(t)}),
    ("old:up-st6", lambda t: {"stages": 6, "down_stages": _down_stages(t)}),
    ("old:up-k2x", lambda t: {"up_block_k": 2 * t.up_block_k, "stages": 3,
                              "down_stages": _down_stages(t)}),
    ("old:up-n32", lambda t: {"up_block_n": 32, "stages": 3, "down_stages": _down_stages(t)}),
)


def up_stream_configs(top_k: int, fp8: bool) -> list[tuple[str, Any]]:
    """UP_STREAMS as (variant name, moe_decode.DecodeConfig) on the table's entry for top_k
    routed slots (batch 1)."""
    from shard.kernels import moe_decode

    base = moe_decode.decode_config_for(top_k, fp8)
    assert base is not None and not base.route_inside
    return [(name, dataclasses.replace(base, up_stream=per_sm, up_block_n=rows,
                                       up_block_k=k8 if fp8 else k16, stages=stages,
                                       down_stages=base.down_stages or base.stages))
            for name, rows, k16, k8, stages, per_sm in UP_STREAMS]


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    fused_router: bool  # shard.layers.moe.fused_router
    attention: Any = None  # CudaAttentionBackend.few_program_decode (DecodeTiling) or None
    router: Any = None  # moe_router.RouterConfig or None (its default)
    norm_prologue: bool = False  # shard.layers.linear.norm_prologue (the input norm in qkv)
    moe_config: Any = None  # moe_decode.config_override (the expert launches' config) or None
    warm_o: bool = False  # shard.layers.attention.WARM_O_PROJ (o_proj warmed into L2)
    fuse_qk_norm: bool = True  # shard.layers.attention.FUSE_QK_NORM (q/k norms in attention)
    router_norm: bool = True  # shard.layers.moe.ROUTER_NORM (add + norm in the router GEMV)
    merge_by_split: bool = True  # attention_decode.merge_by_split (the split merge's form)
    short_decode: bool = True  # CudaAttentionBackend.short_decode (a short-context graph)
    # The o_proj shape's batch-1 GEMV choice replaced (o_proj_choice): "cublas", the index of a
    # candidate in gemv.configs_for(1, bf16), or a CUDA-core tile outside them (O_PROJ_TILES);
    # None: its tuned choice
    o_proj: str | int | tuple[int, int, int, int] | None = None


def o_proj_variants() -> list[Variant]:
    """Round 20: the o_proj GEMV streams at 63 % of copy in the bf16 step, q/k/v at 88 % (call 6's
    critical path); its choice is tuned in isolation (decode_linear's timing, L2 cleared). Each
    batch-1 candidate and cuBLAS in the step instead (bf16 only: fp8 weights take their own
    GEMV)."""
    import torch

    from shard.kernels.gemv import configs_for

    n = len(configs_for(1, torch.bfloat16))
    return ([Variant(f"old:oproj-c{i}", False, o_proj=i) for i in range(n)]
            + [Variant("old:oproj-cublas", False, o_proj="cublas")]
            + [Variant(f"old:oproj-{rows}x{k}w{warps}st{stages}", False,
                       o_proj=(rows, k, warps, stages)) for rows, k, warps, stages in O_PROJ_TILES])


# CUDA-core tiles (rows, K tile, warps, stages) outside the 16-bit candidates, for o_proj's long
# rows (4,096 against the hidden 2,048): fewer K iterations a program, one load when whole
# (gemv.py: whole 4,096-wide fp8 rows lost on Llama-3-8B's shapes).
O_PROJ_TILES = ((2, 2048, 4, 1), (1, 4096, 4, 1), (2, 4096, 8, 1), (4, 2048, 8, 1),
                (1, 2048, 4, 1))


@contextlib.contextmanager
def o_proj_choice(model: Any, choice: str | int | None) -> Iterator[str]:
    """Inside the block the o_proj weight shape's batch-1 GEMV runs `choice` (Variant.o_proj);
    yields the tuned choice's description (what the block replaced)."""
    import torch

    from shard.kernels.gemv import config_dict, configs_for
    from shard.layers import decode_linear

    weight = getattr(model.model.layers[0].self_attn.o_proj, "weight", None)  # [H, heads * D]
    if weight is None or weight.dtype not in decode_linear.GEMV_DTYPES:
        yield ""  # (fp8 weights: their own GEMV, not tuned here)
        return
    record = decode_linear.tune(weight, weight.dtype)
    key = decode_linear.shape_key(weight, weight.dtype, None, False)
    tuned = record[1]
    described = (f"tuned {tuned.backend.value} {config_dict(tuned.config)} triton "
                 f"{tuned.triton_us:.2f} us cublas {tuned.cublas_us:.2f} us")
    if choice is None:
        yield described
        return
    if choice == "cublas":
        forced = dataclasses.replace(tuned, backend=decode_linear.Backend.CUBLAS)
    elif isinstance(choice, tuple):
        from shard.kernels.gemv import _config

        rows, k, warps, stages = choice
        forced = dataclasses.replace(tuned, backend=decode_linear.Backend.TRITON,
                                     config=_config(rows, k, warps, stages, False))
    else:
        forced = dataclasses.replace(tuned, backend=decode_linear.Backend.TRITON,
                                     config=configs_for(1, torch.bfloat16)[int(choice)])
    decode_linear._TUNED[key] = {**record, 1: forced}
    try:
        yield described + f" -> {forced.backend.value} {config_dict(forced.config)}"
    finally:
        decode_linear._TUNED[key] = dict(record)


def _fp8_subset(variants: list[Variant]) -> list[Variant]:
    """fp8 (time): the old step's variants, fused, the norm prologue, the first attention tiling
    (the sweep's best)."""
    attn = [v for v in variants if v.name.startswith("fused+attn:")][:1]
    return [v for v in variants if v.name in ("fused", "fused+norm-prologue")
            or v.name == "old" or v.name.startswith(("old:", "old+"))] + attn


def _variants(best: dict | None, kv_heads: int, cuda: bool) -> list[Variant]:
    """The most telling first."""
    from shard.attention.cuda_backend import DecodeTiling
    from shard.kernels.moe_router import RouterConfig

    out = [Variant("old", False), Variant("fused", True)]
    if not cuda:
        return out + [Variant("fused+norm-prologue", True, norm_prologue=True)]
    # round 17: the default step with fewer warps per attention program (fewer CTA barriers in
    # its chain of dependent steps: the routing launch gained 1.5 us a layer from one warp)
    out += [Variant(f"old+attn:{t.name()}", False, t)
            for t in (DecodeTiling(kv_heads, *tiling) for tiling in OLD_ATTN_TILINGS)]
    # the attention's merge as one block (before round 18; attention_decode.merge_by_split)
    out.append(Variant("old:block-merge", False, merge_by_split=False))
    # before round 20: no second graph for steps whose contexts fit 512 positions
    # (CudaAttentionBackend.short_decode, 32-position K/V tiles: s16-n32-w4-st3's gain at
    # context 512 without its loss at long contexts, which the default graph keeps)
    out.append(Variant("old:no-short-graph", False, short_decode=False))
    tilings: list[DecodeTiling] = []
    if best is not None:
        tilings.append(DecodeTiling(kv_heads, best["splits"], best["block_n"], best["num_warps"]))
    tilings += [DecodeTiling(kv_heads, s) for s in MODEL_SPLITS]
    seen = set()
    for t in tilings:
        if t.name() not in seen:
            seen.add(t.name())
            out.append(Variant(f"fused+attn:{t.name()}", True, t))
    out.append(Variant("fused+norm-prologue", True, norm_prologue=True))
    if best is not None:
        out.append(Variant(f"fused+norm-prologue+attn:{tilings[0].name()}", True, tilings[0],
                           norm_prologue=True))
    out += [Variant(f"fused:router-r{r}w{w}", True, router=RouterConfig(r, w))
            for r, w in ROUTER_CONFIGS]
    return out


def step_stamps(runner: Any, step: Any, context: int, replays: int = 5) -> dict:
    """The step's stamped launches (attention, routing, gate/up, down; shard/kernels/stamps.py)
    from a graph captured under a StampRecorder, after `replays` replays: their phases by kernel
    (benchmarks/harness/stamps.step_phases), us."""
    import torch

    from benchmarks.harness.stamps import step_phases
    from shard.kernels import stamps
    from shard.runner.cuda_graphs import CudaGraphDecodeRunner

    recorder = stamps.StampRecorder(1 << 18, runner.device)
    with stamps.recording(recorder):  # eager warm-up: scratch rows; the capture: the buffer
        graphs = CudaGraphDecodeRunner(runner.forward, runner.device, runner.block_size, 1,
                                       -(-context // runner.block_size), buckets=[1])
        graphs.capture()
    for _ in range(replays):
        graphs.run(step.token_ids, step.positions, step.seq_lens, step.block_tables)
    torch.cuda.synchronize()
    rows = recorder.buffer.cpu().numpy()
    return step_phases([(launch.kernel, rows[launch.first:launch.first + launch.programs],
                         launch.points) for launch in recorder.launches])


def stamps_lines(phases: dict) -> list[str]:
    """step_stamps' result, a line a kernel."""
    lines = []
    for kernel, p in phases.items():
        steps = ", ".join(f"{k.removeprefix('critical: ')} {v:.2f}" for k, v in p.items()
                          if k.startswith("critical: "))
        lines.append(f"  stamps {kernel:10s} x{p['count']:3d}: span {p['span']:.2f} gap "
                     f"{p.get('gap', float('nan')):.2f} early {p.get('early', float('nan')):.2f}"
                     f" | critical: {steps}")
    return lines


def bench_model_b1(model_dir: Path, shape: dict, copy_bps: float, cuda: bool,
                   quantize: str | None, alias_from: int | None, best_attn: dict | None,
                   subset: bool = False, variant_names: str | None = None,
                   profile: bool = True, stamped: bool = False) -> dict:
    import torch

    from benchmarks.harness.timing import cuda_time_ms, decode_step, gpu_state
    from benchmarks.harness.tp import prefill_logits_8b
    from shard.distributed.groups import Dist
    from shard.layers.attention import FUSE_QK_NORM, WARM_O_PROJ
    from shard.layers.linear import norm_prologue
    from shard.layers.moe import ROUTER_NORM, fused_router
    from shard.server.loader import Shard, ShardConfig

    device = "cuda" if cuda else "cpu"
    t0 = time.perf_counter()
    target = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    alias = aliased_layers(alias_from, target) if alias_from else contextlib.nullcontext()
    with alias:
        shard = Shard(ShardConfig(model_id=str(model_dir), dtype="bfloat16" if cuda else "float32",
                                  device=device, quantize=quantize), Dist())
    runner, model = shard.runner, shard.runner.model
    layers = len(model.model.layers)
    out: dict[str, Any] = {"layers": layers, "quantize": quantize or "bf16",
                           "load_s": time.perf_counter() - t0, "variants": []}
    context = CONTEXT if cuda else 32
    runner.allocate_kv_cache(2 * -(-context // runner.block_size) + 2)
    for k_cache, v_cache in runner.kv_cache:  # random K/V: never time on zeros
        for cache in (k_cache, v_cache):
            cache.copy_(torch.randn(cache.shape, device=device).to(cache.dtype))
    prefill_logits_8b(runner, length=64, keep=4)  # first eager step: tunes GEMVs, warms MoE
    step = decode_step(1, context, runner.block_size)
    model.routing_stats.take()
    runner.execute(step)
    touched = [sum(1 for c in layer if c) for layer in model.routing_stats.take()]
    kv_token = runner.kv_bytes_per_block() // runner.block_size
    parts = _step_bytes(model, touched, _expert_bytes(shape, quantize == "fp8"), 1, context,
                        kv_token, shape["hidden_size"])
    out["bytes"] = parts
    out["roofline_ms"] = sum(parts.values()) / copy_bps * 1e3 if cuda else float("nan")
    backends = list({id(a.backend): a.backend for a in model.attns}.values())
    kv_heads = shape["num_key_value_heads"]
    from shard.attention.cuda_backend import ShortDecode
    from shard.kernels import attention_decode, moe_decode, moe_router

    variants = _variants(best_attn, kv_heads, cuda)
    variants = _fp8_subset(variants) if subset else variants
    if moe_decode.decode_config_for(shape["num_experts_per_tok"], quantize == "fp8").down_split:
        # the table's batch-1 entry before the split down launch (its 32-slot entry), A/B
        variants.insert(1, Variant("old:no-split", False,
                                   moe_config=moe_decode.DECODE_CONFIGS[quantize == "fp8"][-1][1]))
    if cuda:  # the old step with the persistent gate/up launch, after `old` (and old:no-split)
        at = 1 + sum(v.name == "old:no-split" for v in variants)
        variants[at:at] = [Variant(name, False, moe_config=cfg) for name, cfg in
                           up_stream_configs(shape["num_experts_per_tok"], quantize == "fp8")]
        # the attention launch warms o_proj's weight into L2 (shard/kernels/l2_warm.py)
        variants.insert(1, Variant("old:warm-o", False, warm_o=True))
        # the q/k norms as their own launch (before round 16), A/B
        variants.insert(1, Variant("old:qk-norm-apart", False, fuse_qk_norm=False))
        # the routing launch with four warps (before round 16); the input add + norm inside the
        # q/k/v GEMV
        table = moe_decode.decode_config_for(shape["num_experts_per_tok"], quantize == "fp8")
        variants.insert(1, Variant("old:route-w4", False,
                                   moe_config=dataclasses.replace(table, route_warps=4)))
        variants.insert(1, Variant("old:norm-prologue", False, norm_prologue=True))
        # the post-attention add + norm inside the router GEMV's launch (routing apart), alone
        # and with the input add + norm inside the q/k/v GEMV
        variants[2:2] = [Variant("old:no-router-norm", False, router_norm=False)]
        # round 17: the routing launch lets gate/up launch as it starts; the fused-sum down
        # launch's ids before its wait (a guess); both; bf16's fused sum as the split launch
        variants[1:1] = [Variant(name, False, moe_config=dataclasses.replace(table, **opts))
                         for name, opts in ROUND17_CONFIGS]
        variants[1:1] = [Variant(name, False, moe_config=dataclasses.replace(table, **opts(table)))
                         for name, opts in ROUND19_CONFIGS]
        variants[1:1] = o_proj_variants()
    if variant_names:  # in the order given; a name given twice runs twice (interleaved A/B)
        by_name = {v.name: v for v in variants}
        variants = [by_name[n] for n in variant_names.split(",") if n in by_name]
    for var in variants:
        name = var.name
        row: dict[str, Any] = {"variant": name}
        if var.moe_config is not None:
            row["moe_config"] = var.moe_config.name()
        try:
            for backend in backends:
                backend.few_program_decode = var.attention
                backend.short_decode = ShortDecode() if var.short_decode else None
            with fused_router(var.fused_router), moe_router.config_override(var.router), \
                    norm_prologue(var.norm_prologue), moe_decode.config_override(var.moe_config), \
                    WARM_O_PROJ.override(var.warm_o), FUSE_QK_NORM.override(var.fuse_qk_norm), \
                    attention_decode.merge_by_split(var.merge_by_split), \
                    ROUTER_NORM.override(var.router_norm), \
                    (o_proj_choice(model, var.o_proj) if cuda
                     else contextlib.nullcontext("")) as o_proj:
                row["o_proj"] = o_proj
                if cuda:
                    # this variant's graph (captured under its settings: every bucket runs
                    # eagerly first, compiling its kernels), its replay time and its kernels
                    from shard.runner.cuda_graphs import CudaGraphDecodeRunner

                    per = -(-context // runner.block_size)
                    graphs = CudaGraphDecodeRunner(
                        runner.forward, runner.device, runner.block_size, 1, per, buckets=[1],
                        short_context=runner.attention.short_decode_context)
                    graphs.capture()
                    graphs.run(step.token_ids, step.positions, step.seq_lens, step.block_tables)
                    row["short_graph"] = graphs.last_short
                    replay = (graphs.short_graphs if graphs.last_short
                              else graphs.graphs)[graphs.bucket(1)].replay
                    ms = cuda_time_ms(replay, iters=50)
                    row["gpu"] = gpu_state(torch.cuda.current_device())
                    row["step_ms"] = ms
                    row["pct_of_roofline"] = out["roofline_ms"] / ms * 100
                    if profile:  # CUPTI replays: the critical path by kernel
                        row["kernels"] = kernel_table(replay, 5, layers)
                    del graphs, replay
                    if stamped:  # a graph of its own, with the stamped kernel variants
                        row["stamps"] = step_stamps(runner, step, context)
                else:
                    runner.execute(step)
                    t1 = time.perf_counter()
                    runner.execute(step)
                    row["step_ms"] = (time.perf_counter() - t1) * 1e3
        except Exception as exc:  # noqa: BLE001 - recorded; the next variant still runs
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            for backend in backends:
                backend.few_program_decode = None
                backend.short_decode = ShortDecode()  # the default
        out["variants"].append(row)
        gpu = row.get("gpu") or {}
        print(f"model {layers}L {out['quantize']} b=1 {name}: "
              f"{row.get('step_ms', float('nan')):.3f} ms/step "
              f"({row.get('pct_of_roofline', float('nan')):.1f}% of roofline "
              f"{out['roofline_ms']:.3f} ms)"
              + (f" [sm {gpu.get('clocks.sm')} MHz, {gpu.get('temperature.gpu')} C, "
                 f"{gpu.get('power.draw')} W, throttle {gpu.get('clocks_throttle_reasons.active')}]"
                 if gpu else ""), flush=True)
        for line in stamps_lines(row.get("stamps") or {}):
            print(line, flush=True)
        if row.get("o_proj"):
            print(f"  o_proj GEMV at batch 1: {row['o_proj']}", flush=True)
    runner.kv_cache = None
    runner.graphs = None
    del shard, runner, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


# ---- report --------------------------------------------------------------------------------

_SHORT = (("_gate_up_kernel", "gate/up"), ("_gate_up_stream_kernel", "gate/up-stream"),
          ("_down_sum_kernel", "down+sum"),
          ("_add_norm_route_kernel", "add+norm+router+route"), ("_route_kernel", "route"),
          ("_qk_rms_norm_kernel", "qk-norm"),
          ("_decode_split_kernel", "attention"), ("_add_rms_norm_kernel", "add+norm"),
          ("_rms_norm_kernel", "norm"), ("gemv", "gemv"))


def _short(name: str) -> str:
    for key, short in _SHORT:
        if key in name:
            return short
    return name[:28]


def kernel_line(table: dict, layers: int) -> str:
    """'kernels/step N: gate/up 15.6 (48), ...' us per layer for kernels that run once a layer
    or more, us per step for the rest."""
    merged: dict[str, list[float]] = {}
    for r in table["rows"]:
        k = _short(r["name"])
        m = merged.setdefault(k, [0.0, 0])
        m[0] += r["us"]
        m[1] += r["count"]
    parts = []
    for k, (us, n) in sorted(merged.items(), key=lambda kv: -kv[1][0])[:9]:
        parts.append(f"{k} {us / layers:.1f}us/L x{n / layers:.2g}" if n >= layers
                     else f"{k} {us:.0f}us/step x{n}")
    return (f"{table['kernels_per_step']} kernels/step, sum {table['kernel_sum_us'] / 1e3:.3f} "
            f"ms; per layer: " + ", ".join(parts))


def exposed_line(table: dict) -> str:
    """'attention > gemv > add+norm 6.1, ...': the ten largest critical-path charges, us a
    layer (kernel_table's exposed rows), and their sum."""
    rows = table.get("exposed") or []
    total = sum(r["us_per_layer"] for r in rows)
    return (f"{total:.1f} us/L in all; " + ", ".join(
        f"{r['name']} {r['us_per_layer']:.1f}" for r in rows[:10]))


def summary(res: dict) -> list[str]:
    lines = [(f"== MoE batch-1 summary: {res.get('device')}, {LAYERS} layers, ctx {CONTEXT}, "
              f"CUDA graphs, copy {res.get('copy_gbps', float('nan')):.0f} GB/s ==")]
    a = res.get("attention") or {}
    if a.get("rows"):
        d, best = a["default"], a.get("best") or {}
        top = ", ".join(f"{r['tiling']} {r['us_per_layer']:.1f}" for r in a["rows"][:6]
                        if "us_per_layer" in r)
        failed = sum(1 for r in a["rows"] if "error" in r)
        lines.append(f"attention kernel alone (b=1, {a['kv_bytes_per_layer'] / 1e6:.1f} MB K/V "
                     f"a layer): default {d['tiling']} {d['us_per_layer']:.1f} us; best "
                     f"{best.get('tiling')} {best.get('us_per_layer', float('nan')):.1f} us; "
                     f"top: {top}" + (f"; {failed} tilings failed/skipped" if failed else ""))
    by_q: dict[str, dict] = {m["quantize"]: m for m in res.get("models", [])}
    for q, m in by_q.items():
        base = next((v for v in m["variants"] if v["variant"] == "old" and "step_ms" in v), None)
        for v in m["variants"]:
            if "step_ms" not in v:
                lines.append(f"{q} {v['variant']}: ERROR {v.get('error', '')[:150]}")
                continue
            delta = (f", {v['step_ms'] - base['step_ms']:+.3f} ms vs old "
                     f"({(v['step_ms'] - base['step_ms']) * 1e3 / m['layers']:+.1f} us/layer)"
                     if base is not None and v is not base else "")
            lines.append(f"{q} {v['variant']}: {v['step_ms']:.3f} ms/step, "
                         f"{v.get('pct_of_roofline', float('nan')):.1f}% of roofline "
                         f"{m['roofline_ms']:.3f} ms{delta}")
        ok = [v for v in m["variants"] if "kernels" in v]
        for v in ([ok[0], min(ok, key=lambda v: v["step_ms"])] if ok else []):
            lines.append(f"  {q} {v['variant']} kernels: {kernel_line(v['kernels'], m['layers'])}")
            lines.append(f"  {q} {v['variant']} exposed: {exposed_line(v['kernels'])}")
        if ok and ok[0] is min(ok, key=lambda v: v["step_ms"]):
            lines.pop()  # the same variant twice
        b = m.get("bytes", {})
        lines.append(f"  {q} roofline bytes (MB): " + ", ".join(
            f"{k} {v / 1e6:.0f}" for k, v in b.items()))
    if "bf16" in by_q and "fp8" in by_q:
        def best(m: dict) -> dict:
            return min((v for v in m["variants"] if "step_ms" in v),
                       key=lambda v: v["step_ms"], default={"step_ms": float("nan")})

        def named(m: dict, n: str) -> float:
            return next((v["step_ms"] for v in m["variants"] if v["variant"] == n
                         and "step_ms" in v), float("nan"))

        b16, f8 = by_q["bf16"], by_q["fp8"]
        lines.append(f"fp8 vs bf16 b=1 step: old {named(b16, 'old') / named(f8, 'old'):.2f}x, "
                     f"fused {named(b16, 'fused') / named(f8, 'fused'):.2f}x, best "
                     f"{best(b16)['step_ms'] / best(f8)['step_ms']:.2f}x (target >= 1.6x)")
        lines.append(f"bf16 best: {best(b16).get('variant')} {best(b16)['step_ms']:.3f} ms = "
                     f"{best(b16).get('pct_of_roofline', float('nan')):.1f}% of roofline "
                     f"(target >= 75%)")
    for k, v in res.get("errors", {}).items():
        lines.append(f"ERROR {k}: {v[:200]}")
    return lines


def write_report(res: dict, out: Path) -> None:
    (out / "moe_b1.json").write_text(json.dumps(res, indent=1, default=str))
    md = [("# MoE decode at batch 1 (Qwen3-30B-A3B shape): old vs fused router vs attention "
           "tilings"), "", *summary(res), ""]
    a = res.get("attention") or {}
    if a.get("rows"):
        md += ["## Attention kernel alone, us per layer", "", "| tiling | us | programs |",
               "|---|---|---|"]
        md += [f"| {r['tiling']} | {r.get('us_per_layer', float('nan')):.2f} | "
               f"{r.get('programs', '')} |" for r in a["rows"]]
        md.append("")
    for m in res.get("models", []):
        for v in m["variants"]:
            if "kernels" not in v:
                continue
            md += [f"## {m['quantize']} {v['variant']}: kernels of one step", "",
                   "| kernel | us/step | count | us/layer |", "|---|---|---|---|"]
            md += [f"| {r['name']} | {r['us']:.1f} | {r['count']} | {r['us_per_layer']:.2f} |"
                   for r in v["kernels"]["rows"][:16]]
            md.append("")
    (out / "MOE_B1.md").write_text("\n".join(md))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_b1_bench")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/moe-b1"))
    p.add_argument("--parts", default="attention,bf16,fp8")
    p.add_argument("--tiny", action="store_true", help="CPU dry run on a small shape")
    p.add_argument("--variants", default=None,
                   help="comma-separated model variant names, run in this order; a name "
                        "may repeat (interleaved A/B) (default: all)")
    p.add_argument("--stamps", action="store_true",
                   help="each variant's step also from a graph with the stamped kernels "
                        "(attention, routing, gate/up, down): their phases (step_stamps)")
    p.add_argument("--no-profile", action="store_true",
                   help="no per-kernel CUPTI replays (step times only). Use it for step-time "
                        "A/Bs: after a CUPTI session, graph replays in the same process run "
                        "slower (measured in round 18: bf16 +0.1 ms, fp8 +0.24 ms a step)")
    args = p.parse_args(argv)
    t_start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    shape = TINY if args.tiny else QWEN3_30B_A3B
    cuda = not args.tiny
    res: dict[str, Any] = {"shape": shape, "errors": {}, "models": []}

    attempt = part_runner(res, lambda: write_report(res, args.out))

    copy_bps = float("nan")
    if cuda:
        import torch

        from benchmarks.harness.timing import measure_ceilings
        from shard.kernels import tuning_cache
        from shard.server.main import tuning_cache_of

        tuning_cache.configure(tuning_cache_of(None))
        res["device"] = torch.cuda.get_device_name()
        copy_bps = measure_ceilings()["copy_bytes_per_s"]
        res["copy_gbps"] = copy_bps / 1e9
    if "attention" in parts and cuda:
        def attn() -> None:
            res["attention"] = attention_sweep(shape)
        attempt("attention", attn)
    store = args.workdir / "store"
    attempt("checkpoint", lambda: res.setdefault(
        "checkpoint", write_checkpoint(store, shape, STORED, "cuda" if cuda else "cpu")))
    full = LAYERS if cuda else STORED + 4
    d = link_model(store, args.workdir / f"qwen3-moe-{full}l", full)
    best = (res.get("attention") or {}).get("best")
    default_us = ((res.get("attention") or {}).get("default") or {}).get("us_per_layer")
    if best is not None and default_us is not None and best["us_per_layer"] >= default_us:
        best = None  # the default is as good: no extra variant for it
    for q in ("bf16", "fp8"):
        if q in parts:
            attempt(f"model_{q}", lambda q=q: res["models"].append(bench_model_b1(
                d, shape, copy_bps, cuda, None if q == "bf16" else "fp8", STORED, best,
                subset=q == "fp8", variant_names=args.variants, profile=not args.no_profile,
                stamped=args.stamps)))
    res["wall_s"] = time.time() - t_start
    write_report(res, args.out)
    print("\n".join(summary(res)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
