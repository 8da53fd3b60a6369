"""LoRA kernels of one decode layer alone (issue 25), on CUDA: per-kernel device time and the
per-layer cost inside CUDA graphs at batch 64, with 1 adapter, 4 adapters and half base rows.

    python -m benchmarks.lora_kernels --out benchmarks/raw/lora_kernels_h100.json

Builds the four adapted linears of a Llama-3-8B layer exactly as the shard holds them
(shard.layers.lora.LoraWeights: q/k/v and gate/up stacked, B block-diagonal, 4 slots of rank
16, random adapters) and the layer's base weights, for `--layers` distinct layers (their
weights are far beyond L2, as in a real step), then captures CUDA graphs of all layers:
  base       the four linears as the base model runs them at batch 64 (cuBLAS GEMMs, and
             F.linear + silu_mul for gate/up: decode_linear's path above GEMV_MAX_M rows)
  lora       the same with the LoRA kernels (what a LoRA decode graph runs per layer; the
             gate/up expand does the SiLU-and-mul)
  lora_only  only the LoRA kernels, on preallocated outputs
  op:<name>  one projection group's LoRA kernels only (qkv, o, gate_up, down)
and times their replays (CUDA events, median), divided by the layer count: us per layer, and
(lora - base) x 32 layers as the step's LoRA cost against the issue's budget (4 adapters at most
15 % over a 9.611 ms base step: ~1.44 ms, ~45 us per layer). torch.profiler (CUPTI records
kernels replayed from graphs) gives each op's kernels' device us. Then, in the same process,
PDL off, and a few alternatives of the kernels' block constants (module constants patched in
this process only) timed on the lora graph, so that one device call also says which way to tune.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    hidden: int = 4096  # Llama-3-8B on one GPU: 32 q heads / 8 kv heads of 128
    inter: int = 14336
    q_out: int = 4096
    kv_out: int = 1024


TINY = Shape(hidden=256, inter=320, q_out=256, kv_out=64)  # --check on CPU
LAYERS_PER_STEP = 32
BASE_STEP_MS = 9.611  # benchmarks/LORA.md, H100, batch 64, context 1024
TARGET = 0.15

# Alternatives timed after the defaults (module constants of shard/kernels/lora.py).
SWEEP: list[dict[str, int]] = [  # most telling first (the sweep stops at its time budget)
    {"EXPAND_BLOCK_M": 32},
    {"MAX_SPLITS": 4},
    {"SILU_MAX_SPLITS": 8},
    {"SHRINK_BLOCK_K": 64},
    {"SILU_BLOCK_N": 128},
    {"EXPAND_BLOCK_N": 64},
    {"SILU_MAX_SPLITS": 2},
    {"MAX_SPLITS": 16, "SPLIT_RANKS_MAX": 256},
]


@dataclass
class Layer:
    w_qkv: object  # [6144, 4096] bf16
    w_o: object  # [4096, 4096]
    w_gu: object  # [28672, 4096]
    w_down: object  # [4096, 14336]
    qkv: object  # LoraWeights
    o: object
    gu: object
    down: object


def _lora(specs, batch, rank, device, dtype, gen):
    import torch

    from shard.layers.lora import LoraPart, LoraWeights

    parts, at = [], 0
    for name, fan_in, fan_out in specs:
        parts.append(LoraPart(name, fan_in, fan_out, (0, fan_in), (0, fan_out), at))
        at += fan_out
    w = LoraWeights(parts, batch, rank, device, dtype)
    for slot in range(batch.num_slots):
        w.write_slot(slot, [
            ((torch.randn(rank, fi, device=device, generator=gen) * 0.01).to(dtype),
             (torch.randn(fo, rank, device=device, generator=gen) * 0.01).to(dtype))
            for _, fi, fo in specs])  # fmt: skip
    return w


def build(sh: Shape, layers: int, slots: int, rank: int, device, gen
          ) -> tuple[list[Layer], object]:
    import torch

    from shard.layers.lora import LoraBatch

    dtype = torch.bfloat16
    batch = LoraBatch(slots)

    def w(n, k):
        return (torch.randn(n, k, device=device, generator=gen) * 0.02).to(dtype)

    out = []
    for _ in range(layers):
        out.append(Layer(
            w(sh.q_out + 2 * sh.kv_out, sh.hidden), w(sh.hidden, sh.q_out),
            w(2 * sh.inter, sh.hidden), w(sh.hidden, sh.inter),
            _lora([("q", sh.hidden, sh.q_out), ("k", sh.hidden, sh.kv_out),
                   ("v", sh.hidden, sh.kv_out)], batch, rank, device, dtype, gen),
            _lora([("o", sh.q_out, sh.hidden)], batch, rank, device, dtype, gen),
            _lora([("gate", sh.hidden, sh.inter), ("up", sh.hidden, sh.inter)], batch, rank,
                  device, dtype, gen),
            _lora([("down", sh.inter, sh.hidden)], batch, rank, device, dtype, gen),
        ))  # fmt: skip
    return out, batch


class Bench:
    def __init__(self, sh: Shape, layers: list[Layer], batch, rows: int, device, gen):
        import torch

        self.sh, self.layers, self.batch, self.device = sh, layers, batch, device

        def randn(*size):
            return torch.randn(*size, device=device, generator=gen).to(torch.bfloat16)

        self.x = randn(rows, sh.hidden)
        self.act = randn(rows, sh.inter)
        # lora_only outputs (the deltas accumulate over replays: fine for timing)
        self.y_qkv = randn(rows, sh.q_out + 2 * sh.kv_out)
        self.y_o = randn(rows, sh.hidden)
        self.y_gu = randn(rows, 2 * sh.inter)
        self.y_down = randn(rows, sh.hidden)
        self.slot_buf = torch.zeros(rows, dtype=torch.int32, device=device)
        batch.set_device_rows(self.slot_buf)
        # lora_overlapped: a side stream and one partials buffer per projection group
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.bufs = [torch.empty(16 * rows * 64, dtype=torch.float32, device=device)
                     for _ in range(4)]

    def base(self) -> None:
        import torch.nn.functional as F

        from shard.kernels.elementwise import silu_mul

        x, inter = self.x, self.sh.inter
        for layer in self.layers:
            F.linear(x, layer.w_qkv)
            F.linear(x, layer.w_o)
            gu = F.linear(x, layer.w_gu)
            act = silu_mul(gu[:, :inter], gu[:, inter:])
            F.linear(act, layer.w_down)

    def lora(self) -> None:
        import torch.nn.functional as F

        x = self.x
        for layer in self.layers:
            qkv = F.linear(x, layer.w_qkv)
            layer.qkv.apply_(x, qkv)
            o = F.linear(x, layer.w_o)  # (the attention output's stand-in: x)
            layer.o.apply_(x, o)
            gu = F.linear(x, layer.w_gu)
            act = layer.gu.silu_mul(x, gu)
            down = F.linear(act, layer.w_down)
            layer.down.apply_(act, down)

    def lora_overlapped(self) -> None:
        """An experiment, not the shard's path: each shrink on a side stream, concurrent with
        its base GEMM (it reads only the GEMM's input), joined before the expand."""
        import torch
        import torch.nn.functional as F

        from shard.kernels.lora import (
            SILU_MAX_SPLITS,
            lora_expand_,
            lora_expand_silu_mul,
            lora_shrink,
        )

        main, side = torch.cuda.current_stream(self.device), self.side
        slots, ns = self.slot_buf, self.batch.num_slots

        def fork(w, inp, max_splits, buf):
            side.wait_stream(main)
            with torch.cuda.stream(side):
                return lora_shrink(inp, w.a[:ns], slots, w.max_rank, max_splits, out=buf)

        def expand(w, y, part):
            main.wait_stream(side)
            lora_expand_(y, part, w.b[:ns], slots, w.part_sizes, w.max_rank)

        x = self.x
        for layer in self.layers:
            part = fork(layer.qkv, x, None, self.bufs[0])
            expand(layer.qkv, F.linear(x, layer.w_qkv), part)
            part = fork(layer.o, x, None, self.bufs[1])
            expand(layer.o, F.linear(x, layer.w_o), part)
            part = fork(layer.gu, x, SILU_MAX_SPLITS, self.bufs[2])
            gu = F.linear(x, layer.w_gu)
            main.wait_stream(side)
            act = lora_expand_silu_mul(gu, part, layer.gu.b[:ns], slots, layer.gu.max_rank,
                                       SILU_MAX_SPLITS)
            part = fork(layer.down, act, None, self.bufs[3])
            expand(layer.down, F.linear(act, layer.w_down), part)

    def op(self, name: str) -> None:
        x = self.x
        for layer in self.layers:
            if name == "qkv":
                layer.qkv.apply_(x, self.y_qkv)
            elif name == "o":
                layer.o.apply_(x, self.y_o)
            elif name == "gate_up":
                layer.gu.silu_mul(x, self.y_gu)
            else:
                layer.down.apply_(self.act, self.y_down)

    def lora_only(self) -> None:
        for name in ("qkv", "o", "gate_up", "down"):
            self.op(name)

    def graph(self, fn):
        import torch

        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()  # compile / load every kernel variant before capture
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize(self.device)
        return g


def replay_us(graph, per: int, iters: int = 40) -> float:
    """Median replay time (CUDA events) divided by `per` (layers in the graph)."""
    import torch

    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / per)
    return statistics.median(times)


def kernel_us(graph, per: int, replays: int = 5) -> dict:
    """torch.profiler over graph replays: {kernel name: [device us per layer, launches per
    layer]}, by time ({"error": ...} where the profiler fails: the timings still count)."""
    try:
        return _kernel_us(graph, per, replays)
    except Exception as exc:  # noqa: BLE001 - e.g. no CUPTI on the machine
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def _kernel_us(graph, per: int, replays: int) -> dict[str, list[float]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t <= 0 or evt.count <= 0:
            continue
        name = evt.key[:70]
        out[name][0] += t / replays / per
        out[name][1] += evt.count / replays / per
    return {k: [round(v[0], 2), round(v[1], 2)]
            for k, v in sorted(out.items(), key=lambda kv: -kv[1][0])}


def patterns(rows: int, slots: int) -> dict[str, list[int]]:
    return {
        "1_adapter": [0] * rows,
        f"{slots}_adapters": [i % slots for i in range(rows)],
        "mixed_half_base": [-1 if i % 2 == 0 else (i // 2) % slots for i in range(rows)],
    }


def check(args: argparse.Namespace) -> int:
    """Each path once on CPU with tiny shapes (the torch path of LoraWeights; the kernels
    themselves are checked under Triton's interpreter by tests/shard)."""
    import torch

    device = torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    layers, batch = build(TINY, 2, args.slots, args.rank, device, gen)
    bench = Bench(TINY, layers, batch, 8, device, gen)
    for p in patterns(8, args.slots).values():
        bench.slot_buf.copy_(torch.tensor(p, dtype=torch.int32))
        batch.set_rows(p, device)  # the CPU path's gathers
        bench.base()
        bench.lora()
        bench.lora_only()
    print(json.dumps({"check": "ok", "shape": str(TINY)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="distinct layers per graph")
    ap.add_argument("--rows", type=int, default=64, help="decode batch")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=4, help="--max-loras")
    ap.add_argument("--sweep-budget-s", type=float, default=75.0,
                    help="stop the block-constant sweep after this many seconds")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--check", action="store_true",
                    help="CPU check of the script: tiny shapes, each path run once, no timing")
    args = ap.parse_args(argv)
    if args.check:
        return check(args)

    import torch

    from shard.kernels import lora as kernels
    from shard.kernels import pdl

    t0 = time.perf_counter()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    sh = Shape()
    layers, batch = build(sh, args.layers, args.slots, args.rank, device, gen)
    bench = Bench(sh, layers, batch, args.rows, device, gen)
    pats = patterns(args.rows, args.slots)
    n = args.layers

    def set_slots(p: list[int]) -> None:
        bench.slot_buf.copy_(torch.tensor(p, dtype=torch.int32))

    set_slots(pats["1_adapter"])  # every kernel runs in full for the eager calls
    g_base = bench.graph(bench.base)
    g_lora = bench.graph(bench.lora)
    g_only = bench.graph(bench.lora_only)
    g_ops = {name: bench.graph(lambda name=name: bench.op(name))
             for name in ("qkv", "o", "gate_up", "down")}
    base_us = replay_us(g_base, n)
    cases: dict[str, dict] = {}
    for pname, p in pats.items():
        set_slots(p)
        lora_us = replay_us(g_lora, n)
        extra = lora_us - base_us
        cases[pname] = {
            "layer_us": {"base": round(base_us, 2), "lora": round(lora_us, 2),
                         "lora_minus_base": round(extra, 2),
                         "lora_only": round(replay_us(g_only, n), 2)},
            "op_us": {name: round(replay_us(g, n), 2) for name, g in g_ops.items()},
            "step_extra_ms_x32": round(extra * LAYERS_PER_STEP / 1e3, 3),
            "projected_slowdown": round(extra * LAYERS_PER_STEP / 1e3 / BASE_STEP_MS, 4),
            "kernels_per_op": {name: kernel_us(g, n) for name, g in g_ops.items()},
        }
        if pname != "1_adapter":
            continue
        cases[pname]["kernels_lora_layer"] = kernel_us(g_lora, n)
        cases[pname]["kernels_base_layer"] = kernel_us(g_base, n)
    set_slots(pats[f"{args.slots}_adapters"])
    cases[f"{args.slots}_adapters"]["kernels_lora_layer"] = kernel_us(g_lora, n)
    del g_lora, g_only, g_ops

    defaults = {k: getattr(kernels, k) for k in (
        "SHRINK_BLOCK_M", "SHRINK_BLOCK_K", "MAX_SPLITS", "SILU_MAX_SPLITS",
        "SHRINK_TARGET_PROGRAMS", "SHRINK_MIN_K_PER_SPLIT", "EXPAND_BLOCK_M", "EXPAND_BLOCK_N",
        "SILU_BLOCK_N", "WIDE_MAX_K")}  # fmt: skip
    alt: dict[str, object] = {}
    out = {
        "device": torch.cuda.get_device_name(device),
        "shape": "Llama-3-8B layer (q/k/v 4096/1024/1024, o, gate/up 2x14336, down), bf16",
        "rows": args.rows, "rank": args.rank, "slots": args.slots, "layers_in_graph": n,
        "pdl": pdl.enabled(device), "kernel_constants": defaults,
        "budget_us_per_layer": round(BASE_STEP_MS * TARGET * 1e3 / LAYERS_PER_STEP, 1),
        "cases": cases, "alternatives_lora_minus_base_us": alt,
    }  # fmt: skip
    _report(out, cases, args.out, t0)  # written now too: the sweep may run out of time

    # PDL off (Hopper launches these kernels as programmatic dependents by default).
    p4 = pats[f"{args.slots}_adapters"]
    with pdl.override(False):
        set_slots(pats["1_adapter"])
        g = bench.graph(bench.lora)
        set_slots(p4)
        alt["pdl_off"] = {"lora_minus_base_us_4_adapters": round(replay_us(g, n) - base_us, 2)}
        del g
    print("alternative pdl_off:", alt["pdl_off"], flush=True)
    try:  # the shrinks on a side stream, overlapping the base GEMMs
        set_slots(pats["1_adapter"])
        g = bench.graph(bench.lora_overlapped)
        one = replay_us(g, n) - base_us
        set_slots(p4)
        alt["overlap_shrinks_with_gemms"] = {"lora_minus_base_us_1_adapter": round(one, 2),
                                             "lora_minus_base_us_4_adapters": round(
                                                 replay_us(g, n) - base_us, 2)}
        del g
    except Exception as exc:  # noqa: BLE001 - an experiment
        alt["overlap_shrinks_with_gemms"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    print("alternative overlap:", alt["overlap_shrinks_with_gemms"], flush=True)
    t_sweep = time.perf_counter()
    for change in SWEEP:
        key = json.dumps(change)
        if time.perf_counter() - t_sweep > args.sweep_budget_s:
            alt[key] = "skipped (time budget)"
            continue
        saved = {k: getattr(kernels, k) for k in change}
        try:
            for k, v in change.items():
                setattr(kernels, k, v)
            set_slots(pats["1_adapter"])
            g = bench.graph(bench.lora)
            one = replay_us(g, n) - base_us
            set_slots(p4)
            four = replay_us(g, n) - base_us
            alt[key] = {"lora_minus_base_us_1_adapter": round(one, 2),
                        "lora_minus_base_us_4_adapters": round(four, 2)}
            del g
        except Exception as exc:  # noqa: BLE001 - a variant that fails is a finding, not a crash
            alt[key] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
        finally:
            for k, v in saved.items():
                setattr(kernels, k, v)
        print("alternative", key, alt[key], flush=True)
    _report(out, cases, args.out, t0)
    return 0


def _report(out: dict, cases: dict, path: Path | None, t0: float) -> None:
    """The JSON to --out (complete so far), and a readable summary on stdout."""
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{out['device']}: {out['rows']} rows, rank {out['rank']}, {out['slots']} slots, "
          f"budget {out['budget_us_per_layer']} us/layer, pdl={out['pdl']}, {out['seconds']} s")
    for name, case in cases.items():
        print(f"  {name}: layer us {case['layer_us']}  ops us {case['op_us']}  "
              f"projected slowdown {case['projected_slowdown']:+.1%}")
    for name, case in cases.items():
        for op, kernels in case["kernels_per_op"].items():
            short = {k[:40]: v[0] for k, v in kernels.items()} if "error" not in kernels \
                else kernels
            print(f"  kernels {name} {op}: {short}")
    print("  alternatives:", json.dumps(out["alternatives_lora_minus_base_us"]), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
