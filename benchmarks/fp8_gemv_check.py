"""fp8 weight-only GEMV vs bf16 and the W8A8 path at decode batches, on one GPU (< 90 s on an H200).

    python3 benchmarks/fp8_gemv_check.py --out $OUT/fp8_gemv.json

For the Llama-3-8B linear shapes (N x K: fused q/k/v 6144x4096, o 4096x4096, fused gate/up
28672x4096, down 4096x14336, plus the unfused q/k/v and gate/up shapes 1024x4096 and 14336x4096
that llama.py runs today under --quantize fp8, which fuses only unquantized weights) and batches
M = 1, 2, 4, 8, 16, times per call:
  (a) bf16: F.linear(x, W_bf16)  (cuBLAS);
  (b) W8A8: Fp8Linear with use_gemv=False (Triton per-token activation quantization +
      torch._scaled_mm), the path fp8 took before the GEMV;
  (c) GEMV: Fp8Linear with the autotuned Triton weight-only kernel (shard/quantization/
      shard/kernels/fp8_gemv.py); its first eager call tunes every batch bucket (timed, reported).
Each time is the mean over a CUDA graph that cycles through enough copies of the weight to
overflow L2 (as a decode step's 32 layers do), so every call streams its weight from HBM; the
graph is replayed after a warm replay. Reported per call: microseconds, GB/s of weight bytes
(fp8 + fp32 scales, or bf16) and its % of a measured device-to-device copy (a 1 GiB
`dst.copy_(src)`, counting bytes read + written). Also a correctness spot check (GEMV vs an fp32
reference over the same fp8 weights) and the configs the autotuner picked.

Whole-step estimate: 32 layers x (sum of the layer's linears) per variant and batch; at batch 1,
est_step_ms = bf16_step_ms (measured whole bf16 decode step, default 4.45 ms on an H200) - 32 x the
bf16 fused layer + 32 x the fp8 layer: the step's other kernels (attention, norms, LM head, ...)
kept as they are. Target: bf16_step_ms / est_step_ms >= 1.6 (i.e. <= 2.78 ms).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard.quantization.fp8 import Fp8Linear, quantize_fp8_per_channel

LAYERS = 32
BATCHES = (1, 2, 4, 8, 16)
# name -> (N, K)
SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "kv": (1024, 4096),  # k or v alone (unfused)
    "gate": (14336, 4096),  # gate or up alone (unfused)
}
# Linears of one layer: fused (q/k/v and gate/up stacked) and as llama.py runs fp8 today.
LAYER_FUSED = {"qkv": 1, "o": 1, "gate_up": 1, "down": 1}
LAYER_UNFUSED = {"o": 2, "kv": 2, "gate": 2, "down": 1}  # q has the o shape (4096 x 4096)
VARIANTS = ("bf16", "w8a8", "gemv")
# Bytes each variant's weights cycle through per timing: a few times the 50-60 MB L2.
ROTATION_BYTES = 256 << 20
CALLS_PER_GRAPH = 192


def copy_bandwidth_gbps(device: torch.device, iters: int = 20) -> float:
    """Device-to-device copy of 1 GiB, GB/s counting bytes read + written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    return 2 * src.numel() / seconds / 1e9


def time_calls_us(calls: list[Callable[[], torch.Tensor]], replays: int = 10) -> float:
    """Mean microseconds per call of `calls` (each on its own weight copy), in a CUDA graph."""
    for call in calls:  # eager first: tuning, compiling and module loads happen outside capture
        call()
    torch.cuda.synchronize()
    rounds = max(1, CALLS_PER_GRAPH // len(calls))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for call in calls:
                call()
    graph.replay()  # warm replay
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / (replays * rounds * len(calls))
    del graph
    return us


def bench_shape(
    name: str, n: int, k: int, device: torch.device, copy_gbps: float, seed: int
) -> dict[str, Any]:
    """Times the three variants of one (N, K) at every batch; returns the shape's report."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16)  # [N, K]
    q, scale = quantize_fp8_per_channel(w)  # [N, K] fp8, [N] fp32
    bytes_per = {"bf16": 2 * n * k, "w8a8": n * k + 4 * n, "gemv": n * k + 4 * n}
    copies = {v: max(2, math.ceil(ROTATION_BYTES / b)) for v, b in bytes_per.items()}
    bf16_w = [w] + [w.clone() for _ in range(copies["bf16"] - 1)]
    fp8_w = [(q, scale)] + [(q.clone(), scale.clone()) for _ in range(copies["gemv"] - 1)]
    w8a8 = [Fp8Linear(qi, si, use_gemv=False) for qi, si in fp8_w]
    gemv = [Fp8Linear(qi, si, use_gemv=True) for qi, si in fp8_w]
    assert gemv[0].use_gemv and w8a8[0].use_scaled_mm and not w8a8[0].use_gemv

    # First eager call: autotunes every batch bucket for this (N, K).
    x1 = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    gemv[0](x1)
    torch.cuda.synchronize()
    tune_s = time.perf_counter() - t0

    report: dict[str, Any] = {"n": n, "k": k, "tune_s": round(tune_s, 2), "copies": copies}
    rows = []
    for m in BATCHES:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)  # [M, K]
        calls = {
            "bf16": [partial(F.linear, x, wi) for wi in bf16_w],
            "w8a8": [partial(li, x) for li in w8a8],
            "gemv": [partial(li, x) for li in gemv],
        }
        row: dict[str, Any] = {"m": m}
        for variant in VARIANTS:
            us = time_calls_us(calls[variant])
            gbps = bytes_per[variant] / (us * 1e-6) / 1e9
            row[variant] = {
                "us": round(us, 2),
                "weight_gbps": round(gbps, 1),
                "pct_of_copy": round(100 * gbps / copy_gbps, 1),
            }
        ref = x.float() @ (q.float() * scale[:, None]).t()
        y = gemv[0](x)
        row["gemv_rel_err"] = float((y.float() - ref).norm() / ref.norm())
        row["gemv_vs_bf16"] = round(row["bf16"]["us"] / row["gemv"]["us"], 3)
        rows.append(row)
        print(
            f"{name:8s} {n:6d}x{k:<6d} M={m:2d}  "
            + "  ".join(
                f"{v} {row[v]['us']:7.2f} us {row[v]['weight_gbps']:6.0f} GB/s "
                f"({row[v]['pct_of_copy']:5.1f}%)"
                for v in VARIANTS
            )
            + f"  gemv/bf16 x{row['gemv_vs_bf16']:.2f}  err {row['gemv_rel_err']:.1e}",
            flush=True,
        )
    report["batches"] = rows
    return report


def step_estimates(shapes: dict[str, dict[str, Any]], bf16_step_ms: float) -> dict[str, Any]:
    """32-layer sums of the per-linear times, fused and unfused, per variant and batch."""

    def us(name: str, m: int, variant: str) -> float:
        row = next(r for r in shapes[name]["batches"] if r["m"] == m)
        return row[variant]["us"]

    out: dict[str, Any] = {}
    for m in BATCHES:
        entry: dict[str, float] = {}
        for layout, layer in (("fused", LAYER_FUSED), ("unfused", LAYER_UNFUSED)):
            for variant in VARIANTS:
                total = sum(count * us(name, m, variant) for name, count in layer.items())
                entry[f"{variant}_{layout}_ms"] = round(LAYERS * total / 1e3, 3)
        out[f"m{m}"] = entry
    one = out["m1"]
    rest = bf16_step_ms - one["bf16_fused_ms"]  # attention, norms, LM head, ...: unchanged
    est = {}
    for key in ("gemv_fused_ms", "gemv_unfused_ms", "w8a8_fused_ms", "w8a8_unfused_ms"):
        step = rest + one[key]
        est[key.replace("_ms", "")] = {
            "est_step_ms": round(step, 3),
            "speedup_vs_bf16": round(bf16_step_ms / step, 3),
        }
    out["batch1_step"] = {"bf16_step_ms": bf16_step_ms, "other_kernels_ms": round(rest, 3), **est}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fp8_gemv.json")
    parser.add_argument(
        "--bf16-step-ms",
        type=float,
        default=4.45,
        help="measured batch-1 bf16 decode step (CUDA graph) for the whole-step estimate",
    )
    args = parser.parse_args()
    t_start = time.perf_counter()
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    import triton

    from shard.kernels import fp8_gemv as fp8_gemv_kernel

    copy_gbps = copy_bandwidth_gbps(device)
    print(f"{torch.cuda.get_device_name(device)}: device copy {copy_gbps:.0f} GB/s (read+write)")
    shapes: dict[str, dict[str, Any]] = {}
    for seed, (name, (n, k)) in enumerate(SHAPES.items()):
        shapes[name] = bench_shape(name, n, k, device, copy_gbps, seed)
        torch.cuda.empty_cache()
    steps = step_estimates(shapes, args.bf16_step_ms)
    # (M bucket, N, K, bias, tensor dtypes...) -> the config the autotuner kept.
    tuned = getattr(fp8_gemv_kernel._fp8_gemv_tuned, "cache", {})
    chosen = {str(key): str(cfg) for key, cfg in tuned.items()}
    report = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_gbps": round(copy_gbps, 1),
        "gemv_max_m": fp8_gemv_kernel.GEMV_MAX_M,
        "shapes": shapes,
        "steps": steps,
        "autotuned_configs": chosen,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    one = steps["batch1_step"]
    print(
        f"batch-1 step estimate (bf16 measured {one['bf16_step_ms']} ms, other kernels "
        f"{one['other_kernels_ms']} ms): "
        + ", ".join(
            f"{k} {v['est_step_ms']} ms x{v['speedup_vs_bf16']}"
            for k, v in one.items()
            if isinstance(v, dict)
        )
    )
    for m in BATCHES:
        print(f"  M={m:2d} 32-layer linears ms: {json.dumps(steps[f'm{m}'])}")
    print(f"total {report['seconds']} s")
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
