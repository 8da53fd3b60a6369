"""LoRA kernels of one decode layer alone (issue 25), on CUDA: per-kernel device time and the
per-layer cost inside CUDA graphs at batch 64, with 1 adapter, 4 adapters and half base rows.

    python -m benchmarks.lora_kernels --out benchmarks/raw/lora_kernels_h100.json

Builds the four adapted linears of a Llama-3-8B layer exactly as the shard holds them with LoRA on
(shard.layers.lora.LoraWeights: q/k/v and gate/up stacked, B block-diagonal, 4 slots of rank 16,
random adapters, every slot's A FOLDED into extra rows of the base weight: LoraWeights.fold_into)
for `--layers` distinct layers (their weights are far beyond L2, as in a real step), then
captures CUDA graphs of all layers:
  base        the four linears as the base model runs them at batch 64 (cuBLAS GEMMs on the base
              rows of the weights, and F.linear + silu_mul for gate/up: decode_linear's path
              above GEMV_MAX_M rows)
  wide_gemms  the same on the widened weights (base + every slot's A): the GEMMs' growth alone
  lora        what a LoRA decode graph runs per layer now: the wide GEMMs, each followed by its
              folded expand (the gate/up one does the SiLU-and-mul, replacing silu_mul)
  op:<name>   one projection's wide GEMM + expand, and the same projection's base op: the
              difference is that projection's LoRA cost (qkv, o, gate_up, down)
  expand:<name>  the expand kernel alone on a preallocated wide output
and times their replays (CUDA events, median), divided by the layer count: us per layer, and
(lora - base) x 32 layers as the step's LoRA cost against the issue's budget (4 adapters at most
15 % over a 9.611 ms base step: ~1.44 ms, ~45 us per layer). torch.profiler (CUPTI records
kernels replayed from graphs) gives the layer graphs' kernels' device us (with PDL a kernel's
span starts while its predecessor still runs: read the per-kernel us of PDL kernels as upper
bounds). Then, in the same process: PDL off, the previous design (a shrink kernel per linear
after the base GEMM, then the split-partials expand: `shrink_design`), and alternatives of the
folded expands' block constants (module constants patched in this process only), so that one
device call also says which way to tune.
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
    {"FOLD_BLOCK_N": 64},  # o / down: 64 programs, 97 registers (two per SM)
    {"FOLD_SILU_BLOCK_N": 64},  # gate/up: 224 programs, two waves
    {"FOLD_BLOCK_M": 32},
    {"FOLD_BLOCK_N": 256},
    {"FOLD_BLOCK_N": 32},
    {"FOLD_BLOCK_M": 32, "FOLD_SILU_BLOCK_N": 64},
]
FOLD_CONSTANTS = ("FOLD_BLOCK_M", "FOLD_BLOCK_N", "FOLD_SILU_BLOCK_N", "FOLD_NUM_WARPS")
OPS = ("qkv", "o", "gate_up", "down")


@dataclass
class Layer:
    w_qkv: object  # [6144, 4096] bf16: the base rows of wide_qkv
    w_o: object  # [4096, 4096]
    w_gu: object  # [28672, 4096]
    w_down: object  # [4096, 14336]
    wide_qkv: object  # [6144 + 4 slots x 48, 4096]: base rows + every slot's A
    wide_o: object  # [4096 + 64, 4096]
    wide_gu: object  # [28672 + 128, 4096]
    wide_down: object  # [4096 + 64, 14336]
    qkv: object  # LoraWeights (folded)
    o: object
    gu: object
    down: object


def _lora(specs, batch, rank, base, device, dtype, gen):
    """A LoraWeights folded into `base` [out, in] with random adapters in every slot:
    (lora, wide weight, base view)."""
    import torch

    from shard.layers.lora import LoraPart, LoraWeights

    parts, at = [], 0
    for name, fan_in, fan_out in specs:
        parts.append(LoraPart(name, fan_in, fan_out, (0, fan_in), (0, fan_out), at))
        at += fan_out
    w = LoraWeights(parts, batch, rank, device, dtype)
    wide = w.fold_into(base)
    assert wide is not None
    for slot in range(batch.num_slots):
        w.write_slot(slot, [
            ((torch.randn(rank, fi, device=device, generator=gen) * 0.01).to(dtype),
             (torch.randn(fo, rank, device=device, generator=gen) * 0.01).to(dtype))
            for _, fi, fo in specs])  # fmt: skip
    return w, wide, wide[:at]


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
        qkv, wide_qkv, w_qkv = _lora([("q", sh.hidden, sh.q_out), ("k", sh.hidden, sh.kv_out),
                                      ("v", sh.hidden, sh.kv_out)], batch, rank,
                                     w(sh.q_out + 2 * sh.kv_out, sh.hidden), device, dtype, gen)
        o, wide_o, w_o = _lora([("o", sh.q_out, sh.hidden)], batch, rank, w(sh.hidden, sh.q_out),
                               device, dtype, gen)
        gu, wide_gu, w_gu = _lora([("gate", sh.hidden, sh.inter), ("up", sh.hidden, sh.inter)],
                                  batch, rank, w(2 * sh.inter, sh.hidden), device, dtype, gen)
        down, wide_down, w_down = _lora([("down", sh.inter, sh.hidden)], batch, rank,
                                        w(sh.hidden, sh.inter), device, dtype, gen)
        out.append(Layer(w_qkv, w_o, w_gu, w_down, wide_qkv, wide_o, wide_gu, wide_down,
                         qkv, o, gu, down))
    return out, batch


class Bench:
    def __init__(self, sh: Shape, layers: list[Layer], batch, rows: int, device, gen):
        import torch
        import torch.nn.functional as F

        self.sh, self.layers, self.batch, self.device = sh, layers, batch, device

        def randn(*size):
            return torch.randn(*size, device=device, generator=gen).to(torch.bfloat16)

        self.x = randn(rows, sh.hidden)
        self.act = randn(rows, sh.inter)
        # expand-only inputs: the wide outputs of the first layer's GEMMs
        first = layers[0]
        self.y_wide = {"qkv": F.linear(self.x, first.wide_qkv), "o": F.linear(self.x, first.wide_o),
                       "gate_up": F.linear(self.x, first.wide_gu),
                       "down": F.linear(self.act, first.wide_down)}
        self.slot_buf = torch.zeros(rows, dtype=torch.int32, device=device)
        batch.set_device_rows(self.slot_buf)

    def base(self) -> None:
        for name in OPS:
            self.base_op(name)

    def base_op(self, name: str, wide: bool = False) -> None:
        """The base model's op (wide: on the widened weight, its extra columns unused)."""
        import torch.nn.functional as F

        from shard.kernels.elementwise import silu_mul

        x, inter = self.x, self.sh.inter
        for layer in self.layers:
            if name == "qkv":
                F.linear(x, layer.wide_qkv if wide else layer.w_qkv)
            elif name == "o":
                F.linear(x, layer.wide_o if wide else layer.w_o)
            elif name == "gate_up":
                gu = F.linear(x, layer.wide_gu if wide else layer.w_gu)
                silu_mul(gu[:, :inter], gu[:, inter : 2 * inter])
            else:
                F.linear(self.act, layer.wide_down if wide else layer.w_down)

    def wide_gemms(self) -> None:
        for name in OPS:
            self.base_op(name, wide=True)

    def lora(self) -> None:
        """A LoRA decode layer's linears, as the shard runs them (the folded path)."""
        import torch.nn.functional as F

        x = self.x
        for layer in self.layers:
            layer.qkv.expand_folded(F.linear(x, layer.wide_qkv))
            layer.o.expand_folded(F.linear(x, layer.wide_o))  # (attention output's stand-in: x)
            act = layer.gu.silu_mul_folded(F.linear(x, layer.wide_gu))
            layer.down.expand_folded(F.linear(act, layer.wide_down))

    def lora_op(self, name: str) -> None:
        import torch.nn.functional as F

        x = self.x
        for layer in self.layers:
            if name == "qkv":
                layer.qkv.expand_folded(F.linear(x, layer.wide_qkv))
            elif name == "o":
                layer.o.expand_folded(F.linear(x, layer.wide_o))
            elif name == "gate_up":
                layer.gu.silu_mul_folded(F.linear(x, layer.wide_gu))
            else:
                layer.down.expand_folded(F.linear(self.act, layer.wide_down))

    def expand_only(self, name: str) -> None:
        y = self.y_wide[name]
        for layer in self.layers:
            if name == "gate_up":
                layer.gu.silu_mul_folded(y)
            else:
                getattr(layer, name).expand_folded(y)

    def shrink_design(self) -> None:
        """The previous design, for comparison: the base GEMM, then a shrink kernel and the
        split-partials expand per linear (LoraWeights.apply_ / silu_mul on CUDA)."""
        import torch.nn.functional as F

        x = self.x
        for layer in self.layers:
            layer.qkv.apply_(x, F.linear(x, layer.w_qkv))
            layer.o.apply_(x, F.linear(x, layer.w_o))
            act = layer.gu.silu_mul(x, F.linear(x, layer.w_gu))
            layer.down.apply_(act, F.linear(act, layer.w_down))

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
        bench.wide_gemms()
        bench.lora()
        for name in OPS:
            bench.lora_op(name)
            bench.expand_only(name)
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
    g_wide = bench.graph(bench.wide_gemms)
    g_lora = bench.graph(bench.lora)
    g_ops = {name: (bench.graph(lambda name=name: bench.lora_op(name)),
                    bench.graph(lambda name=name: bench.base_op(name))) for name in OPS}
    g_expand = {name: bench.graph(lambda name=name: bench.expand_only(name)) for name in OPS}
    base_us = replay_us(g_base, n)
    wide_us = replay_us(g_wide, n)
    cases: dict[str, dict] = {}
    for pname, p in pats.items():
        set_slots(p)
        lora_us = replay_us(g_lora, n)
        extra = lora_us - base_us
        cases[pname] = {
            "layer_us": {"base": round(base_us, 2), "lora": round(lora_us, 2),
                         "lora_minus_base": round(extra, 2),
                         "wide_gemms_minus_base": round(wide_us - base_us, 2)},
            "op_lora_minus_base_us": {
                name: round(replay_us(g, n) - replay_us(gb, n), 2)
                for name, (g, gb) in g_ops.items()},
            "expand_only_us": {name: round(replay_us(g, n), 2) for name, g in g_expand.items()},
            "step_extra_ms_x32": round(extra * LAYERS_PER_STEP / 1e3, 3),
            "projected_slowdown": round(extra * LAYERS_PER_STEP / 1e3 / BASE_STEP_MS, 4),
        }
        if pname == "1_adapter":
            cases[pname]["kernels_base_layer"] = kernel_us(g_base, n)
        if pname != "mixed_half_base":
            cases[pname]["kernels_lora_layer"] = kernel_us(g_lora, n)
    del g_lora, g_ops, g_expand, g_wide

    defaults = {k: getattr(kernels, k) for k in FOLD_CONSTANTS}
    alt: dict[str, object] = {}
    out = {
        "device": torch.cuda.get_device_name(device),
        "shape": "Llama-3-8B layer (q/k/v 4096/1024/1024, o, gate/up 2x14336, down), bf16",
        "design": "folded: every slot's A in extra rows of the base weight; one expand each",
        "rows": args.rows, "rank": args.rank, "slots": args.slots, "layers_in_graph": n,
        "pdl": pdl.enabled(device), "kernel_constants": defaults,
        "budget_us_per_layer": round(BASE_STEP_MS * TARGET * 1e3 / LAYERS_PER_STEP, 1),
        "cases": cases, "alternatives_lora_minus_base_us": alt,
    }  # fmt: skip
    _report(out, cases, args.out, t0)  # written now too: the sweep may run out of time

    p4 = pats[f"{args.slots}_adapters"]

    def measure(key: str, fn) -> None:
        """lora_minus_base of graph(fn) with 1 and with 4 adapters, into alt[key]."""
        try:
            set_slots(pats["1_adapter"])
            g = bench.graph(fn)
            one = replay_us(g, n) - base_us
            set_slots(p4)
            alt[key] = {"lora_minus_base_us_1_adapter": round(one, 2),
                        "lora_minus_base_us_4_adapters": round(replay_us(g, n) - base_us, 2)}
            del g
        except Exception as exc:  # noqa: BLE001 - a variant that fails is a finding, not a crash
            alt[key] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
        print("alternative", key, alt[key], flush=True)

    with pdl.override(False):  # Hopper launches these kernels as programmatic dependents
        measure("pdl_off", bench.lora)
    measure("shrink_design", bench.shrink_design)  # the previous design, same process
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
            measure(key, bench.lora)
        finally:
            for k, v in saved.items():
                setattr(kernels, k, v)
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
        print(f"  {name}: layer us {case['layer_us']}  projected slowdown "
              f"{case['projected_slowdown']:+.1%}")
        print(f"    per op (wide GEMM + expand - base op) us {case['op_lora_minus_base_us']}")
        print(f"    expand alone us {case['expand_only_us']}")
    for name, case in cases.items():
        for what in ("kernels_lora_layer", "kernels_base_layer"):
            kernels = case.get(what)
            if kernels is None:
                continue
            short = {k[:40]: v for k, v in kernels.items()} if "error" not in kernels \
                else kernels
            print(f"  {what} {name} (us, launches per layer): {short}")
    print("  alternatives:", json.dumps(out["alternatives_lora_minus_base_us"]), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
