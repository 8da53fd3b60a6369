"""Issue 39: the fused MoE path on a Qwen3-30B-A3B-shaped model (random bf16, one GPU).

`python -m benchmarks.moe_bench --out DIR` (benchmarks/run_moe_device.sh calls it) writes
DIR/moe.json and DIR/MOE.md, each part recorded as it finishes (a part that fails records its
error and the next one runs):

1. ceilings: device-to-device copy bandwidth and the bf16 matmul rate (8192^3).
2. layer: LAYERS distinct MoE layers of the real shape (128 experts, top-8, hidden 2048,
   moe_intermediate 768), random router logits, replayed back to back in one CUDA graph (no L2
   reuse between layers): per-layer time at batch 1 / 2 / 4 / 8 / 16 / 64 / 256 (up to 16: also
   the grouped path against the decode kernels with a sweep of their tilings, bf16 and fp8), the experts the step actually
   touched and their bytes over the copy bandwidth (the layer's roofline), the per-expert torch
   loop (transformers' form: a nonzero() per expert, eager) as the naive baseline, fp8 experts
   (per-expert, per-channel scales) against bf16, a sweep of kernel tilings, and a 4,096-token
   prefill against the bf16 matmul rate.
3. model: first the whole model, 48 layers, bf16 and then --quantize fp8, built by the shard's
   own loader and model classes from the stored checkpoint's layers (`aliased_layers`: layer i
   reads layer i % 8's tensors into its own device memory; the full checkpoint would be ~61 GB,
   more than the machine's disk takes in the time): decode in CUDA graphs at batch 1 / 64 / 256
   (those whose K/V fits beside the weights) against each step's byte roofline, fp8 vs bf16 per
   batch (the acceptance table). Then random Qwen3-MoE checkpoints of a few layer counts (4 and
   8 by default), each loaded by the shard's own loader (host memory sampled: the experts are
   stacked without a host copy of the model), decode in CUDA graphs at batch 1 / 64 / 256
   (context CONTEXT), with the roofline of the bytes each step reads: attention, norms and
   routers of every layer, the experts the step touched (counted by the layers' own routing
   statistics), the LM head, the K/V; then per-layer fits extrapolated to 48 layers. The largest
   one with a 4,096-token prefill against the bf16 matmul rate, then again with --quantize fp8.
4. e2e (time allowing): the harness's end-to-end workload through `tokenwire launch` on the
   largest checkpoint.

`--tiny` runs parts 3 and 4's code path on CPU with a small shape (how the script is checked
without a GPU): eager steps, no graphs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import re
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

QWEN3_30B_A3B = {
    "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "intermediate_size": 6144, "vocab_size": 151936, "num_hidden_layers": 48,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
}
TINY = dict(QWEN3_30B_A3B, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            vocab_size=128256 + 64)
BATCHES = [1, 64, 256]
# The layer part also times the small batches around the decode kernels' range
# (shard/kernels/moe_decode.py: up to DECODE_MAX_SLOTS routed slots), both paths at each.
LAYER_BATCHES = [1, 2, 4, 8, 16, 64, 256]
CONTEXT = 512
PREFILL = 4096
FULL_LAYERS = 48


# ---- 2. one layer ----------------------------------------------------------------------------


def _expert_bytes(shape: dict, fp8: bool) -> int:
    h, i = shape["hidden_size"], shape["moe_intermediate_size"]
    return 3 * h * i * (1 if fp8 else 2) + ((2 * i + h) * 4 if fp8 else 0)


def _make_layers(shape: dict, count: int, fp8: bool, device: str = "cuda") -> list[Any]:
    import torch

    from shard.distributed.groups import Dist
    from shard.kernels.moe_align import MoeRouting
    from shard.layers.moe import FusedMoE
    from shard.quantization.fp8 import quantize_fp8_per_channel

    e, h, i = shape["num_experts"], shape["hidden_size"], shape["moe_intermediate_size"]
    routing = MoeRouting(shape["num_experts_per_tok"], renormalize=True)
    layers = []
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for _ in range(count):
        moe = FusedMoE(e, h, i, routing, Dist())
        w13 = torch.randn(e, 2 * i, h, device=device, generator=gen, dtype=dtype) * 0.02
        w2 = torch.randn(e, h, i, device=device, generator=gen, dtype=dtype) * 0.02
        if fp8:
            q13, s13 = zip(*(quantize_fp8_per_channel(w) for w in w13), strict=True)
            q2, s2 = zip(*(quantize_fp8_per_channel(w) for w in w2), strict=True)
            moe.w13.data, moe.w2.data = torch.stack(q13), torch.stack(q2)
            moe.scale13, moe.scale2 = torch.stack(s13), torch.stack(s2)
            del q13, q2
        else:
            moe.w13.data, moe.w2.data = w13, w2
        del w13, w2
        layers.append(moe)
    if device == "cuda":
        torch.cuda.empty_cache()
    return layers


def _graph_ms(fn, iters: int = 20) -> float:
    """ms per replay of fn captured in a CUDA graph (fn ran eagerly first)."""
    import torch

    from benchmarks.harness.timing import cuda_time_ms

    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ms = cuda_time_ms(g.replay, iters=iters)
    del g
    return ms


def bench_layer(shape: dict, ceilings: dict, layers_count: int, res: dict,
                device: str = "cuda") -> None:
    """Fills res["layer"]: fused vs naive vs fp8 per layer, tiling sweep, prefill. On the CPU
    (--tiny: the script's own check) eager wall times, no sweep, no rooflines."""
    import torch

    from benchmarks.harness.timing import wall_time_ms
    from shard.kernels import fused_moe as fm
    from shard.kernels.moe_align import per_expert_loop, route

    cuda = device == "cuda"
    bw = ceilings.get("copy_bytes_per_s", float("nan"))
    peak = ceilings.get("bf16_flops_per_s", float("nan"))
    dtype = torch.bfloat16 if cuda else torch.float32
    e, h, k = shape["num_experts"], shape["hidden_size"], shape["num_experts_per_tok"]
    i = shape["moe_intermediate_size"]
    out: dict[str, Any] = {"layers_in_graph": layers_count, "decode": [], "sweep": {}}
    res["layer"] = out
    gen = torch.Generator(device=device).manual_seed(1)
    for fp8 in (False, True):
        layers = _make_layers(shape, layers_count, fp8, device)
        for b in (LAYER_BATCHES + [PREFILL]) if cuda else [1, 4, 64]:
            xs = [torch.randn(b, h, device=device, generator=gen, dtype=dtype) for _ in layers]
            logits = [torch.randn(b, e, device=device, generator=gen, dtype=dtype)
                      for _ in layers]
            touched = sum(int(torch.unique(route(lg, layers[0].routing)[1]).numel())
                          for lg in logits) / len(layers)

            def step(layers=layers, xs=xs, logits=logits):
                for moe, x, lg in zip(layers, xs, logits, strict=True):
                    moe(x, lg)

            if b == PREFILL or not cuda:
                ms = _wall_ms(step, cuda, iters=5) / len(layers)  # eager, as prefill runs
            else:
                ms = _graph_ms(step) / len(layers)
            row: dict[str, Any] = {"batch": b, "fp8": fp8, "fused_ms": ms,
                                   "experts_touched": touched}
            nbytes = touched * _expert_bytes(shape, fp8) + b * h * 2 * 2 + b * e * 2
            row["bytes_read"] = nbytes
            row["roofline_ms"] = nbytes / bw * 1e3
            row["pct_of_roofline"] = row["roofline_ms"] / ms * 100
            flops = 2 * b * k * 3 * h * i
            row["tflops"] = flops / (ms / 1e3) / 1e12
            row["pct_of_bf16_peak"] = flops / (ms / 1e3) / peak * 100
            if cuda and b * k <= 128:
                row.update(_paths_and_decode_sweep(layers, xs, logits, b * k, fp8))
            if not fp8:
                moe = layers[0]
                w, ids = route(logits[0], moe.routing)
                row["naive_loop_ms"] = _wall_ms(
                    lambda moe=moe, w=w, ids=ids, x=xs[0]: per_expert_loop(
                        x, moe.w13, moe.w2, w, ids), cuda, iters=3 if b == PREFILL else 10)
                row["speedup_vs_naive"] = row["naive_loop_ms"] / ms
                # Tiling sweep (kernels only, layout precomputed) for the table's choice.
                sweep = {}
                from shard.kernels import moe_route

                for cfg in _sweep_configs(b) if cuda else []:
                    try:
                        ids32 = ids.int()
                        lay = moe_route.align(ids32, e, cfg.block_m) if b * k <= \
                            moe_route.ALIGN_MAX_SLOTS else None

                        def kern(cfg=cfg, lay=lay, w=w, ids32=ids32, moe=moe, x=xs[0]):
                            fm.fused_moe(x, moe.w13, moe.w2, w, ids32, config=cfg, layout=lay,
                                         all_local=True)

                        sweep[_cfg_name(cfg)] = (wall_time_ms(kern, iters=3) if b == PREFILL
                                                 else _graph_ms(kern))
                    except Exception as exc:  # noqa: BLE001 - a tiling that does not compile
                        sweep[_cfg_name(cfg)] = f"{type(exc).__name__}: {exc}"[:200]
                out["sweep"][str(b)] = sweep
                row["table_config"] = _cfg_name(fm.config_for(b * k, e))
            out["decode"].append(row)
            print(f"layer b={b} fp8={fp8}: {ms * 1e3:.1f} us/layer, "
                  f"{row['pct_of_roofline']:.0f}% of roofline ({touched:.0f} experts), "
                  f"naive {row.get('naive_loop_ms', float('nan')):.2f} ms", flush=True)
            del xs, logits
        del layers
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    for b in LAYER_BATCHES:
        rows = {r["fp8"]: r for r in out["decode"] if r["batch"] == b}
        if len(rows) == 2:
            out.setdefault("fp8_speedup", {})[str(b)] = rows[False]["fused_ms"] / rows[True][
                "fused_ms"]


def _grouped_layer(moe: Any, x: Any, logits: Any) -> Any:
    """FusedMoE's path past the decode range (route, align, the grouped GEMMs, the sum),
    forced at any batch: the decode kernels' comparison."""
    from shard.kernels import fused_moe as fm
    from shard.kernels import moe_route

    w, ids = moe_route.route(logits, moe.routing)
    cfg = fm.config_for(ids.numel(), moe.w13.shape[0])
    lay = moe_route.align(ids, moe.w13.shape[0], cfg.block_m)
    return fm.fused_moe(x, moe.w13, moe.w2, w, ids, moe.scale13, moe.scale2, cfg, lay,
                        all_local=True)


def _paths_and_decode_sweep(layers: list[Any], xs: list[Any], logits: list[Any], slots: int,
                            fp8: bool) -> dict[str, Any]:
    """At a decode-sized batch: us per layer (same graph of distinct layers) of the grouped path
    and of the decode kernels with each candidate config (routing inside, as the layer runs
    them), so one GPU call shows the crossover and the best tiles for the table."""
    from shard.kernels import moe_decode

    def timed(fn) -> float | str:
        try:
            return _graph_ms(lambda: [fn(m, x, lg) for m, x, lg in
                                      zip(layers, xs, logits, strict=True)]) / len(layers) * 1e3
        except Exception as exc:  # noqa: BLE001 - a tiling that does not compile
            return f"{type(exc).__name__}: {exc}"[:200]

    out: dict[str, Any] = {"grouped_path_us": timed(_grouped_layer)}
    sweep: dict[str, Any] = {}
    for cfg in _decode_sweep_configs(fp8):
        def dec(m, x, lg, cfg=cfg):
            return moe_decode.decode_layer(x, lg, m.w13, m.w2, m.routing, m.scale13, m.scale2,
                                           cfg)
        sweep[_decode_name(cfg)] = timed(dec)
    from shard.kernels import pdl

    table = moe_decode.decode_config_for(slots, fp8)
    if table is not None and pdl.enabled(xs[0].device):
        with pdl.override(False):  # what programmatic dependent launch gives the table config
            sweep[_decode_name(table) + "-no_pdl"] = timed(
                lambda m, x, lg: moe_decode.decode_layer(x, lg, m.w13, m.w2, m.routing,
                                                         m.scale13, m.scale2, table))
    out["decode_sweep_us"] = sweep
    out["decode_table_config"] = _decode_name(table) if table else None
    best = min(((v, n) for n, v in sweep.items() if isinstance(v, float)), default=None)
    if best:
        out["decode_best_us"], out["decode_best_config"] = best
    print(f"layer paths slots={slots} fp8={fp8}: grouped {out['grouped_path_us']} us, decode "
          f"best {best}, table {out['decode_table_config']}", flush=True)
    return out


def _decode_name(cfg: Any) -> str:
    return (f"up{cfg.up_block_n}x{cfg.up_block_k}w{cfg.up_warps}-down{cfg.down_block_n}x"
            f"{cfg.down_block_k}w{cfg.down_warps}-s{cfg.stages}"
            f"{'' if cfg.route_inside else '-route_launch'}"
            f"{'' if cfg.slots_first else '-tiles_first'}")


def _decode_sweep_configs(fp8: bool) -> list[Any]:
    """The decode table's configs first, then alternatives (tile rows, K width, warps, pipelining
    depth; fp8 tiles twice as wide in K for the same bytes)."""
    from shard.kernels.moe_decode import DECODE_CONFIGS, DecodeConfig

    table = [cfg for _, cfg in DECODE_CONFIGS[fp8]]
    kk = 2 if fp8 else 1
    alt = [DecodeConfig(8, 256 * kk, 4, 4, 256 * kk, 4, 4),
           DecodeConfig(16, 256 * kk, 4, 4, 256 * kk, 4, 1),
           DecodeConfig(16, 512 * kk, 4, 8, 256 * kk, 4, 3),
           DecodeConfig(32, 256 * kk, 4, 8, 128 * kk, 4, 4),
           DecodeConfig(8, 512 * kk, 4, 2, 512 * kk, 4, 3),
           DecodeConfig(32, 512 * kk, 8, 16, 256 * kk, 4, 3),
           DecodeConfig(16, 256 * kk, 2, 4, 256 * kk, 2, 4)]
    # each table config also with the routing as its own launch
    sep = [dataclasses.replace(cfg, route_inside=not cfg.route_inside) for cfg in table]
    sep += [dataclasses.replace(cfg, slots_first=not cfg.slots_first) for cfg in table]
    return list(dict.fromkeys(table + sep + alt))


def _wall_ms(fn, cuda: bool, iters: int) -> float:
    """Median wall ms per call (synchronized on CUDA)."""
    if cuda:
        from benchmarks.harness.timing import wall_time_ms

        return wall_time_ms(fn, iters=iters)
    import statistics

    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _cfg_name(cfg: Any) -> str:
    return f"m{cfg.block_m}n{cfg.block_n}k{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}"


def _sweep_configs(batch: int) -> list[Any]:
    from shard.kernels.fused_moe import MoeConfig

    if batch >= 1024:
        return [MoeConfig(64, 128, 64, 8, 3), MoeConfig(64, 64, 64, 4, 4),
                MoeConfig(128, 128, 64, 8, 3), MoeConfig(64, 128, 32, 4, 4),
                MoeConfig(128, 128, 64, 8, 4), MoeConfig(64, 256, 64, 8, 3),
                MoeConfig(128, 64, 64, 4, 4), MoeConfig(64, 128, 64, 4, 4)]
    return [MoeConfig(16, 16, 128, 4, 4), MoeConfig(16, 16, 256, 4, 4),
            MoeConfig(16, 32, 128, 4, 4), MoeConfig(16, 32, 256, 4, 3),
            MoeConfig(16, 64, 128, 4, 4), MoeConfig(16, 64, 64, 4, 5),
            MoeConfig(16, 128, 128, 8, 3), MoeConfig(32, 64, 64, 4, 4)]


# ---- 3. the model --------------------------------------------------------------------------


def write_checkpoint(model_dir: Path, shape: dict, layers: int, device: str) -> dict:
    """Random bf16 Qwen3-MoE checkpoint of `layers` layers (one safetensors file per layer,
    generated on `device`), config and a word-level tokenizer; files already there are kept."""
    import torch
    from safetensors.torch import save_file

    from shard.testing.checkpoint import BOS_ID, EOS_IDS, write_tokenizer

    model_dir.mkdir(parents=True, exist_ok=True)
    h, v, e = shape["hidden_size"], shape["vocab_size"], shape["num_experts"]
    heads, kvh, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    inter = shape["moe_intermediate_size"]
    gen = torch.Generator(device=device).manual_seed(7)
    t0 = time.perf_counter()
    written = 0

    def rnd(*s: int) -> torch.Tensor:
        t = torch.empty(s, dtype=torch.bfloat16, device=device)
        return t.normal_(0.0, 0.02, generator=gen).cpu()

    def save(name: str, make) -> None:
        nonlocal written
        path = model_dir / name
        if path.is_file():
            return
        tensors = make()
        save_file(tensors, str(path.with_suffix(".tmp")), metadata={"format": "pt"})
        path.with_suffix(".tmp").rename(path)
        written += sum(t.numel() * t.element_size() for t in tensors.values())

    def head() -> dict:
        lm = rnd(v, h)
        lm[[i for i in EOS_IDS if i < v]] = 0  # greedy never picks EOS: fixed lengths
        return {"model.embed_tokens.weight": rnd(v, h), "lm_head.weight": lm,
                "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}

    save("embed-head.safetensors", head)
    for li in range(layers):
        def layer(li=li) -> dict:
            p = f"model.layers.{li}."
            t = {p + "self_attn.q_proj.weight": rnd(heads * hd, h),
                 p + "self_attn.k_proj.weight": rnd(kvh * hd, h),
                 p + "self_attn.v_proj.weight": rnd(kvh * hd, h),
                 p + "self_attn.o_proj.weight": rnd(h, heads * hd),
                 p + "self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
                 p + "self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
                 p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                 p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                 p + "mlp.gate.weight": rnd(e, h)}
            for x in range(e):
                q = f"{p}mlp.experts.{x}."
                t[q + "gate_proj.weight"] = rnd(inter, h)
                t[q + "up_proj.weight"] = rnd(inter, h)
                t[q + "down_proj.weight"] = rnd(h, inter)
            return t

        save(f"layer-{li:03d}.safetensors", layer)
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
              "tie_word_embeddings": False, "bos_token_id": BOS_ID,
              "eos_token_id": list(EOS_IDS), **dict(shape, num_hidden_layers=layers)}
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    if not (model_dir / "tokenizer.json").is_file():
        write_tokenizer(model_dir, v)
    return {"layers": layers, "seconds": time.perf_counter() - t0, "bytes_written": written}


def link_model(store: Path, out: Path, layers: int) -> Path:
    """A model directory of the store's first `layers` layers (links, no copies)."""
    out.mkdir(parents=True, exist_ok=True)
    names = ["embed-head.safetensors", *(f"layer-{i:03d}.safetensors" for i in range(layers))]
    for name in names + ["tokenizer.json", "tokenizer_config.json"]:
        if (store / name).exists() and not (out / name).exists():
            (out / name).symlink_to(store / name)
    config = json.loads((store / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def _step_bytes(model: Any, touched_per_layer: list[int], expert_bytes: int, batch: int,
                context: int, kv_bytes_per_token: int, hidden: int) -> dict[str, int]:
    """What one decode step reads: every weight but the embedding table and the experts, the
    experts the step touched, the K/V of each sequence, the embedding rows."""
    from shard.layers.moe import FusedMoE
    from shard.layers.rotary import RotaryEmbedding
    from shard.layers.weights import parameter_bytes

    experts_all = sum(parameter_bytes(m) for m in model.modules() if isinstance(m, FusedMoE))
    embed = parameter_bytes(model.model.embed_tokens)
    # the rotary tables (cos/sin of every position) are buffers but a step reads a few rows
    rotary = sum(parameter_bytes(m) for m in {id(m): m for m in model.modules()
                                               if isinstance(m, RotaryEmbedding)}.values())
    dense = parameter_bytes(model) - embed - experts_all - rotary
    head = parameter_bytes(model.lm_head)
    return {"dense_weights_and_norms": dense - head, "lm_head": head,
            "experts_touched": sum(touched_per_layer) * expert_bytes,
            "kv": batch * context * kv_bytes_per_token, "embedding_rows": batch * hidden * 2}


@contextlib.contextmanager
def aliased_layers(stored: int, target: int) -> Iterator[None]:
    """While active, every checkpoint opened by the shard's loader (shard/layers/weights.py)
    answers `model.layers.{i}.*` for i in [stored, target) with layer i % stored's tensors: a
    `target`-layer model (config num_hidden_layers = target) built through the real model classes
    and loader from a `stored`-layer checkpoint, without writing the full one (48 layers of the
    Qwen3-30B-A3B shape are ~61 GB). Each layer still gets its own device copy, so a step reads
    `target` layers' distinct weights, as the real model's (no L2 reuse between layers)."""
    from shard.layers.weights import Weights

    init, slice_ = Weights.__init__, Weights._slice
    pattern = re.compile(r"model\.layers\.(\d+)\.(.*)")

    def patched_init(self: Weights, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._aliases = {}
        for name, where in list(self._where.items()):
            m = pattern.fullmatch(name)
            if m and int(m[1]) < stored:
                for i in range(int(m[1]) + stored, target, stored):
                    alias = f"model.layers.{i}.{m[2]}"
                    self._where.setdefault(alias, where)
                    self._aliases.setdefault(alias, name)

    def patched_slice(self: Weights, name: str):
        return slice_(self, getattr(self, "_aliases", {}).get(name, name))

    Weights.__init__, Weights._slice = patched_init, patched_slice  # type: ignore[method-assign]
    try:
        yield
    finally:
        Weights.__init__, Weights._slice = init, slice_  # type: ignore[method-assign]


def bench_model(model_dir: Path, shape: dict, ceilings: dict, cuda: bool, quantize: str | None,
                prefill: bool, alias_from: int | None = None) -> dict:
    """alias_from: the checkpoint holds only that many layers (aliased_layers)."""
    import torch

    from benchmarks.harness.scale import AnonPeak, _decode_timings
    from benchmarks.harness.timing import decode_step, prefill_step, wall_time_ms
    from shard.distributed.groups import Dist
    from shard.layers.weights import parameter_bytes
    from shard.server.loader import Shard, ShardConfig

    device = "cuda" if cuda else "cpu"
    t0 = time.perf_counter()
    target = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    alias = aliased_layers(alias_from, target) if alias_from else contextlib.nullcontext()
    with AnonPeak() as anon, alias:
        shard = Shard(ShardConfig(model_id=str(model_dir), dtype="bfloat16" if cuda else "float32",
                                  device=device, quantize=quantize), Dist())
    runner, model = shard.runner, shard.runner.model
    layers = len(model.model.layers)
    out: dict[str, Any] = {"layers": layers, "quantize": quantize,
                           "load_s": time.perf_counter() - t0,
                           "host_anon_peak_gib_while_loading": anon.peak / 2**30,
                           "weights_gib": parameter_bytes(model) / 2**30}
    batches = BATCHES if cuda else [1, 4]
    context = CONTEXT if cuda else 32
    if cuda:  # the batches whose K/V fits beside the weights (48 bf16 layers: ~57 GiB)
        kv_token = runner.kv_bytes_per_block() // runner.block_size
        free = torch.cuda.mem_get_info()[0]
        fits = [b for b in batches if b * context * kv_token * 1.1 + 6 * 2**30 < free]
        out["batches_skipped_for_memory"] = [b for b in batches if b not in fits]
        batches = fits or [1]
    if alias_from:
        out["aliased_from_layers"] = alias_from
    per = math.ceil(max(context, PREFILL if prefill else 0) / runner.block_size)
    runner.allocate_kv_cache(max(batches) * math.ceil(context / runner.block_size) + per + 1)
    for k_cache, v_cache in runner.kv_cache:  # random K/V: never time on zeros
        for cache in (k_cache, v_cache):
            cache.copy_(torch.randn(cache.shape, device=device).to(cache.dtype))
    from benchmarks.harness.tp import prefill_logits_8b

    prefill_logits_8b(runner, length=64, keep=4)  # first eager step: tunes GEMVs, warms MoE
    out.update(_decode_timings(runner, batches, context, cuda))
    # The experts each batch's step touches, by the layers' own routing statistics.
    fp8 = quantize == "fp8"
    expert_bytes = _expert_bytes(shape, fp8)
    kv_per_token = runner.kv_bytes_per_block() // runner.block_size
    for row in out["decode"]:
        b = row["batch"]
        model.routing_stats.take()
        runner.execute(decode_step(b, context, runner.block_size))
        counts = model.routing_stats.take()
        touched = [sum(1 for c in layer if c) for layer in counts]
        parts = _step_bytes(model, touched, expert_bytes, b, context, kv_per_token,
                            shape["hidden_size"])
        row["bytes"] = parts
        row["experts_touched_per_layer"] = sum(touched) / max(len(touched), 1)
        ms = row.get("graph_replay_ms", row.get("eager_wall_ms"))
        if cuda:
            total = sum(parts.values())
            row["roofline_ms"] = total / ceilings["copy_bytes_per_s"] * 1e3
            row["pct_of_roofline"] = row["roofline_ms"] / ms * 100
        print(f"model {layers}L q={quantize} b={b}: {ms:.3f} ms/step "
              f"({row.get('pct_of_roofline', float('nan')):.0f}% of roofline, "
              f"{row['experts_touched_per_layer']:.0f} experts/layer)", flush=True)
        if cuda and b == 1:
            # Where a batch-1 step's time goes: device time per kernel class (CUPTI; eager or
            # graph, the kernels are the same), kernels per step; the replay time minus the sum
            # is launch gaps.
            from benchmarks.harness.kernel_profile import profile_kernels

            step1 = decode_step(1, context, runner.block_size)
            try:
                row["kernel_profile"] = profile_kernels(lambda s=step1, ex=runner.execute: ex(s),
                                                        calls=3)
            except Exception as exc:  # noqa: BLE001 - a profiler that cannot start
                row["kernel_profile"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    if prefill:
        n = PREFILL if cuda else 64
        step = prefill_step(1, n, runner.block_size)
        execute = runner.execute
        ms = wall_time_ms(lambda: execute(step), iters=3, warmup=1) if cuda else float("nan")
        h, k = shape["hidden_size"], shape["num_experts_per_tok"]
        heads, kvh, hd = shape["num_attention_heads"], shape["num_key_value_heads"], \
            shape["head_dim"]
        per_token = 2 * (h * (heads + 2 * kvh) * hd + heads * hd * h
                         + k * 3 * h * shape["moe_intermediate_size"] + h * shape["num_experts"])
        attn = 4 * heads * hd * n * n / 2  # causal QK^T and PV
        flops = layers * (n * per_token + attn) + 2 * n * h * shape["vocab_size"] / n  # 1 logit
        out["prefill"] = {"tokens": n, "ms": ms, "flops": flops}
        if cuda:
            out["prefill"]["pct_of_bf16_peak"] = flops / (ms / 1e3) / ceilings[
                "bf16_flops_per_s"] * 100
            print(f"model {layers}L prefill {n}: {ms:.1f} ms, "
                  f"{out['prefill']['pct_of_bf16_peak']:.0f}% of bf16 peak", flush=True)
    runner.kv_cache = None
    runner.graphs = None
    del shard, runner, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def _step_ms(row: dict) -> float:
    return row.get("graph_replay_ms", row.get("eager_wall_ms", float("nan")))


def full_model_summary(models: list[dict], layers: int) -> dict:
    """The acceptance figures of the whole (aliased) model: each batch's step against its byte
    roofline, bf16 and fp8, and fp8's speed-up over bf16 per batch."""
    out: dict[str, Any] = {"layers": layers}
    by_q = {m.get("quantize"): m for m in models if m.get("layers") == layers and "decode" in m}
    for q, m in by_q.items():
        out[q or "bf16"] = {str(r["batch"]): {"step_ms": _step_ms(r),
                                              "roofline_ms": r.get("roofline_ms"),
                                              "pct_of_roofline": r.get("pct_of_roofline")}
                            for r in m["decode"]}
    if None in by_q and "fp8" in by_q:
        out["fp8_speedup"] = {b: out["bf16"][b]["step_ms"] / r["step_ms"]
                              for b, r in out["fp8"].items() if b in out["bf16"]}
    return out


def extrapolate(models: list[dict], target: int) -> dict:
    """Per batch: least-squares (fixed ms, ms per layer) over the bf16 models, the step at
    `target` layers, and its roofline the same way."""
    from benchmarks.harness.scale import fit_layers

    out: dict[str, Any] = {}
    bf16 = [m for m in models if not m.get("quantize") and "decode" in m]
    for b in {r["batch"] for m in bf16 for r in m["decode"]}:
        pts = [(m["layers"], r.get("graph_replay_ms", r.get("eager_wall_ms"))) for m in bf16
               for r in m["decode"] if r["batch"] == b]
        roof = [(m["layers"], r["roofline_ms"]) for m in bf16 for r in m["decode"]
                if r["batch"] == b and "roofline_ms" in r]
        fit, rfit = fit_layers(pts), fit_layers(roof)
        if fit and rfit:
            step = fit[0] + fit[1] * target
            roofline = rfit[0] + rfit[1] * target
            out[str(b)] = {"fixed_ms": fit[0], "ms_per_layer": fit[1], "step_ms": step,
                           "roofline_ms": roofline, "pct_of_roofline": roofline / step * 100}
            # fp8 measured at one layer count: its per-layer cost with the bf16 fit's fixed
            # part (embedding, LM head and final norm stay bf16 under --quantize fp8).
            for m in sorted(models, key=lambda m: m.get("layers", 0)):  # the largest last
                if m.get("quantize") == "fp8" and "decode" in m:
                    r = next((r for r in m["decode"] if r["batch"] == b), None)
                    if r is not None:
                        ms = r.get("graph_replay_ms", r.get("eager_wall_ms"))
                        per_layer = (ms - fit[0]) / m["layers"]
                        fp8_step = fit[0] + per_layer * target
                        out[str(b)].update(fp8_ms_per_layer=per_layer, fp8_step_ms=fp8_step,
                                           fp8_speedup=step / fp8_step)
    return out


# ---- report ----------------------------------------------------------------------------------


def part_runner(res: dict[str, Any],
                save: Callable[[], None]) -> Callable[[str, Callable[[], object]], None]:
    """attempt(name, fn): runs one part of a benchmark; an exception is printed and recorded in
    res["errors"][name] (the next part still runs), and the report saved after each part."""

    def attempt(name: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - recorded; the next part still runs
            traceback.print_exc()
            res["errors"][name] = f"{type(exc).__name__}: {exc}"[:500]
        save()

    return attempt


def write_report(res: dict, out: Path) -> None:
    (out / "moe.json").write_text(json.dumps(res, indent=1, default=str))
    lines = ["# Fused MoE on a Qwen3-30B-A3B shape", ""]
    c = res.get("ceilings") or {}
    if c:
        lines.append(f"Device: {res.get('device')}; copy {c['copy_bytes_per_s'] / 1e9:.0f} GB/s, "
                     f"bf16 matmul {c['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s.")
    lay = res.get("layer") or {}
    if lay.get("decode"):
        lines += ["", f"## One MoE layer ({lay['layers_in_graph']} distinct layers per graph)", "",
                  ("| tokens | weights | fused us | experts touched | bytes read | roofline us | "
                  "% roofline | TFLOP/s | naive loop ms | speed-up |"), "|" + "---|" * 10]
        for r in lay["decode"]:
            lines.append(
                f"| {r['batch']} | {'fp8' if r['fp8'] else 'bf16'} | {r['fused_ms'] * 1e3:.1f} | "
                f"{r['experts_touched']:.1f} | {r['bytes_read'] / 1e6:.1f} MB | "
                f"{r['roofline_ms'] * 1e3:.1f} | {r['pct_of_roofline']:.0f} | {r['tflops']:.0f} | "
                f"{r.get('naive_loop_ms', float('nan')):.2f} | "
                f"{r.get('speedup_vs_naive', float('nan')):.1f}x |")
        best = []
        for b, sweep in (lay.get("sweep") or {}).items():
            ok = {n: v for n, v in sweep.items() if isinstance(v, float)}
            row = next((r for r in lay["decode"] if str(r["batch"]) == b and not r["fp8"]), {})
            if ok:
                name = min(ok, key=ok.get)
                best.append(f"b={b}: {name} {ok[name] * 1e3:.1f} us (table "
                            f"{row.get('table_config')}: "
                            f"{_us(ok.get(row.get('table_config'), float('nan')) * 1e3)} us)")
        if best:
            lines += ["", "Grouped-GEMM tiling sweep (kernels only, bf16), best per batch: "
                      + "; ".join(best)]
        paths = [r for r in lay["decode"] if "grouped_path_us" in r]
        if paths:
            lines += ["", ("Decode-sized batches, us per layer: the grouped path (route, align, "
                           "GEMMs, sum) vs the decode kernels (shard/kernels/moe_decode.py) with "
                           "the table's config and the sweep's best"), "",
                      ("| tokens | weights | layer us (as served) | grouped path us | decode, "
                       "table config us | decode best us | best config |"), "|" + "---|" * 7]
            for r in paths:
                sweep = r.get("decode_sweep_us", {})
                table = sweep.get(r.get("decode_table_config") or "", float("nan"))
                lines.append(
                    f"| {r['batch']} | {'fp8' if r['fp8'] else 'bf16'} | "
                    f"{r['fused_ms'] * 1e3:.1f} | {_us(r['grouped_path_us'])} | {_us(table)} | "
                    f"{_us(r.get('decode_best_us', float('nan')))} | "
                    f"{r.get('decode_best_config', '-')} |")
        if lay.get("fp8_speedup"):
            lines += ["", "fp8 / bf16 layer speed-up: " + ", ".join(
                f"b={b}: {s:.2f}x" for b, s in lay["fp8_speedup"].items())]
    for m in res.get("models") or []:
        if "error" in m:
            lines += ["", f"model {m.get('layers')} layers: ERROR {m['error']}"]
            continue
        aliased = (f", layers aliased from a {m['aliased_from_layers']}-layer checkpoint"
                   if m.get("aliased_from_layers") else "")
        lines += ["", (f"## Model, {m['layers']} layers{aliased}, quantize={m['quantize']} "
                  f"(load {m['load_s']:.0f} s, host anon peak "
                  f"{m['host_anon_peak_gib_while_loading']:.1f} GiB, weights "
                  f"{m['weights_gib']:.1f} GiB)"), "",
                  ("| batch | step ms | roofline ms | % | experts/layer | bytes (dense+norms, "
                  "LM head, experts, KV) |"), "|---|---|---|---|---|---|"]
        for r in m["decode"]:
            p = r["bytes"]
            lines.append(
                f"| {r['batch']} | {r.get('graph_replay_ms', r.get('eager_wall_ms')):.3f} | "
                f"{r.get('roofline_ms', float('nan')):.3f} | "
                f"{r.get('pct_of_roofline', float('nan')):.0f} | "
                f"{r['experts_touched_per_layer']:.1f} | {p['dense_weights_and_norms'] / 1e6:.0f} "
                f"+ {p['lm_head'] / 1e6:.0f} + {p['experts_touched'] / 1e6:.0f} + "
                f"{p['kv'] / 1e6:.0f} MB |")
        for r in m["decode"]:
            kp = r.get("kernel_profile") or {}
            if kp.get("classes"):
                top = list(kp["classes"].items())[:14]
                lines.append(
                    f"\nbatch {r['batch']} kernels per step: {kp['kernels_per_call']}, device "
                    f"sum {kp['kernel_sum_ms']:.3f} ms (replay "
                    f"{_step_ms(r):.3f} ms); by class, ms (kernels): " + ", ".join(
                        f"{c} {v[0]:.3f} ({v[1]})" for c, v in top))
        if m.get("prefill"):
            p = m["prefill"]
            lines.append(f"\nprefill {p['tokens']} tokens: {p['ms']:.1f} ms, "
                         f"{p.get('pct_of_bf16_peak', float('nan')):.0f}% of the bf16 matmul rate")
    fm = res.get("full_model") or {}
    if fm.get("bf16"):
        lines += ["", f"## Whole model, {fm['layers']} layers (acceptance)", "",
                  "| batch | bf16 step ms | % of its roofline | fp8 step ms | % | fp8 speed-up |",
                  "|---|---|---|---|---|---|"]
        for b, r in sorted(fm["bf16"].items(), key=lambda kv: int(kv[0])):
            f = (fm.get("fp8") or {}).get(b, {})
            lines.append(
                f"| {b} | {r['step_ms']:.3f} | {_us(r['pct_of_roofline'])} | "
                f"{_us(f.get('step_ms', '-'))} | {_us(f.get('pct_of_roofline', '-'))} | "
                f"{_us((fm.get('fp8_speedup') or {}).get(b, '-'))} |")
        lines.append("\nBars (issue 39): batch 1 bf16 >= 75 % of its roofline; fp8 batch 1 >= 1.6x "
                     "bf16.")
    if res.get("fp8_model_speedup_b1"):
        lines += ["", (f"fp8 model batch-1 step speed-up over bf16: "
                  f"{res['fp8_model_speedup_b1']:.2f}x (target >= 1.6x)")]
    if res.get("extrapolated"):
        lines += ["", (f"## Extrapolated to {FULL_LAYERS} layers (least squares over the layer "
                  "counts)"), "", "| batch | ms/layer | fixed ms | step ms | roofline ms | % |",
                  "|---|---|---|---|---|---|"]
        for b, r in sorted(res["extrapolated"].items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {b} | {r['ms_per_layer']:.3f} | {r['fixed_ms']:.3f} | "
                         f"{r['step_ms']:.2f} | {r['roofline_ms']:.2f} | "
                         f"{r['pct_of_roofline']:.0f} |")
        fp8 = {b: r for b, r in res["extrapolated"].items() if "fp8_step_ms" in r}
        if fp8:
            lines += ["", f"fp8 (--quantize fp8) at {FULL_LAYERS} layers, the bf16 fit's fixed part "
                      "with the measured fp8 per-layer cost: " + ", ".join(
                          f"b={b}: {r['fp8_step_ms']:.2f} ms ({r['fp8_speedup']:.2f}x bf16)"
                          for b, r in sorted(fp8.items(), key=lambda kv: int(kv[0])))]
    if res.get("e2e"):
        e = res["e2e"]
        lines += ["", f"e2e ({e.get('layers')} layers): " + ", ".join(
            f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in e.items()
            if k in ("ok", "requests", "requests_per_s", "output_tokens_per_s", "ttft_p50_ms",
                     "itl_p50_ms", "errors"))]
    for part, err in (res.get("errors") or {}).items():
        lines += ["", f"{part}: ERROR {err}"]
    (out / "MOE.md").write_text("\n".join(lines) + "\n")


def _us(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)[:40]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_bench")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/moe-bench"))
    p.add_argument("--layers", default="4,8", help="model layer counts (comma-separated)")
    p.add_argument("--full-layers", type=int, default=FULL_LAYERS,
                   help="also the whole model at this many layers (bf16 and --quantize fp8), "
                   "built from the largest checkpoint's layers (aliased_layers); 0: off")
    p.add_argument("--layer-graph-layers", type=int, default=8)
    p.add_argument("--parts", default="layer,model,fp8,e2e")
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="parts not started by then are skipped (e2e needs ~90 s)")
    p.add_argument("--e2e-requests", type=int, default=200)
    p.add_argument("--tiny", action="store_true", help="CPU dry run on a small shape")
    args = p.parse_args(argv)
    t_start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    shape = TINY if args.tiny else QWEN3_30B_A3B
    cuda = not args.tiny
    res: dict[str, Any] = {"shape": shape, "errors": {}, "models": []}

    attempt = part_runner(res, lambda: write_report(res, args.out))

    if cuda:
        import torch

        from benchmarks.harness.timing import measure_ceilings
        from shard.kernels import tuning_cache
        from shard.server.main import tuning_cache_of

        # The decode GEMVs' tuning on disk, as `tokenwire shard` keeps it: the models measured
        # here and the e2e deployment after them tune each linear shape once.
        tuning_cache.configure(tuning_cache_of(None))
        res["device"] = torch.cuda.get_device_name()
        res["ceilings"] = measure_ceilings()
    if "layer" in parts:
        attempt("layer", lambda: bench_layer(shape, res.get("ceilings", {}),
                                             args.layer_graph_layers, res,
                                             "cuda" if cuda else "cpu"))
    counts = sorted((int(x) for x in args.layers.split(",")), reverse=True)
    store = args.workdir / "store"

    def fp8() -> None:
        """The largest model again with --quantize fp8: its batch-1 step against bf16's."""
        d = args.workdir / f"qwen3-moe-{counts[0]}l"
        m = bench_model(d, shape, res.get("ceilings", {}), cuda, "fp8", prefill=False)
        res["models"].append(m)
        base = next((x for x in res["models"] if x["layers"] == m["layers"]
                     and not x.get("quantize") and "decode" in x), None)
        if base:
            def b1(x: dict) -> float:
                r = next(r for r in x["decode"] if r["batch"] == 1)
                return r.get("graph_replay_ms", r.get("eager_wall_ms"))
            res["fp8_model_speedup_b1"] = b1(base) / b1(m)

    if "model" in parts:
        def write() -> None:
            res["checkpoint"] = write_checkpoint(store, shape, counts[0],
                                                 "cuda" if cuda else "cpu")
        attempt("checkpoint", write)
        # The whole model first (the acceptance figures: bf16, then --quantize fp8), then the
        # largest checkpoint and its fp8 run, then the per-layer fit's smaller models.
        full = args.full_layers if cuda else counts[0] + 4  # --tiny: the code path only
        if full > counts[0]:
            d = link_model(store, args.workdir / f"qwen3-moe-{full}l", full)
            for quantize in (None, "fp8") if "fp8" in parts else (None,):
                attempt(f"model_{full}_{quantize or 'bf16'}", lambda d=d, q=quantize: res[
                    "models"].append(bench_model(d, shape, res.get("ceilings", {}), cuda, q,
                                                 prefill=False, alias_from=counts[0])))
            res["full_model"] = full_model_summary(res["models"], full)
            write_report(res, args.out)
        for n in counts:
            d = link_model(store, args.workdir / f"qwen3-moe-{n}l", n)
            attempt(f"model_{n}", lambda d=d, n=n: res["models"].append(
                bench_model(d, shape, res.get("ceilings", {}), cuda, None,
                            prefill=n == counts[0])))
            if n == counts[0] and "fp8" in parts:
                attempt("fp8", fp8)
        res["extrapolated"] = extrapolate(res["models"], FULL_LAYERS) if cuda else {}
    if "e2e" in parts and time.time() - t_start < args.budget_s:
        def e2e() -> None:
            from benchmarks.harness import bench

            hp = argparse.ArgumentParser()
            bench.add_arguments(hp)
            hargs = hp.parse_args(["--out", str(args.out), "--workdir", str(args.workdir),
                                   "--requests", str(args.e2e_requests)])
            hargs.e2e_device = "cpu" if args.tiny else "cuda"
            hargs.e2e_timeout = 150.0
            hargs.e2e_profile_from_step = None  # no device timeline: time is short
            if args.tiny:
                hargs.requests, hargs.clients, hargs.e2e_warmup_requests = 4, 2, 0
            d = args.workdir / f"qwen3-moe-{counts[0]}l"
            res["e2e"] = dict(bench.bench_e2e(d, hargs, args.out / "e2e_server.log"),
                              layers=counts[0])
        attempt("e2e", e2e)
    res["wall_s"] = time.time() - t_start
    write_report(res, args.out)
    print((args.out / "MOE.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
