"""bf16 linears at decode batches: cuBLAS vs the tuned Triton GEMV, Llama-3-8B at TP=1 and TP=2.

    python3 benchmarks/gemv_check.py --out $OUT/gemv.json      (one GPU, < 3 min on an H200)

For the Llama-3-8B linear shapes N x K at TP=1 and per rank at TP=2 (fused q/k/v 6144 / 3072 x
4096, o 4096 x 4096 / 2048, fused gate/up 28672 / 14336 x 4096 plain and with the fused SiLU-and-
mul epilogue, down 4096 x 14336 / 7168, LM head 128256 / 64128 x 4096) and batches M = 1, 2, 4,
8, 16, times per call:
  cublas: F.linear(x, W) (gate_up_silu: F.linear + elementwise.silu_mul), what the model runs now;
  triton: the Triton GEMV (shard/kernels/gemv.py) with its tuned config;
both through shard/layers/decode_linear.py with the backend forced, after decode_linear.tune() (timed,
reported), which also records the dispatcher's pick per batch bucket (reported as `picked`).
Each time is the mean over a CUDA graph of many calls (launch gaps as in a decode step) that
cycle through enough copies of the weight to overflow the L2 (60 MB on an H200), so every call
streams its weight from HBM. Reported per call: microseconds, GB/s of weight bytes and its % of
a measured device-to-device copy (1 GiB, read + write counted), the relative error of both
backends against an fp32 reference, and per TP and batch the 32-layer sum of one layer's
linears (q/k/v, o, gate/up + SiLU, down) plus the LM head for cublas, triton and the pick.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Shared with the fp8 check (this script's directory is on sys.path).
from fp8_gemv_check import copy_bandwidth_gbps, time_calls_us

from shard.layers import decode_linear
from shard.layers.decode_linear import Backend
from shard.kernels.gemv_buckets import m_bucket

LAYERS = 32
BATCHES = (1, 2, 4, 8, 16)
DTYPE = torch.bfloat16
# name -> ((N, K) at TP=1, (N, K) per rank at TP=2, fused SiLU epilogue)
SHAPES: dict[str, tuple[tuple[int, int], tuple[int, int], bool]] = {
    "qkv": ((6144, 4096), (3072, 4096), False),
    "o": ((4096, 4096), (4096, 2048), False),
    "gate_up": ((28672, 4096), (14336, 4096), False),
    "gate_up_silu": ((28672, 4096), (14336, 4096), True),
    "down": ((4096, 14336), (4096, 7168), False),
    "lm_head": ((128256, 4096), (64128, 4096), False),
}
# One decoder layer's linears as the model runs them on CUDA (gate/up merged, SiLU after it).
LAYER = ("qkv", "o", "gate_up_silu", "down")
BACKENDS = (Backend.CUBLAS, Backend.TRITON)
# Bytes the weight copies of one timing cycle through: 4x the H200's 60 MB L2.
ROTATION_BYTES = 240 << 20


def _op(silu: bool) -> Callable[..., torch.Tensor]:
    return decode_linear.gate_up_silu if silu else decode_linear.linear


def reference(x: torch.Tensor, w: torch.Tensor, silu: bool) -> torch.Tensor:
    """fp32 x @ w.T, [M, N] (silu: silu(gate) * up of gate and up rounded to bf16, [M, N/2]);
    by row blocks, so the LM head needs no 2 GB fp32 copy."""
    out = torch.cat([x.float() @ blk.float().t() for blk in w.split(16384)], dim=1)
    if not silu:
        return out
    gate, up = out.to(DTYPE).float().chunk(2, dim=-1)
    return F.silu(gate) * up


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def bench_shape(
    name: str, tp: int, n: int, k: int, silu: bool, copy_gbps: float, seed: int
) -> dict[str, Any]:
    """Tunes, then times both backends of one (N, K) at every batch; the shape's report."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(DTYPE)  # [N, K]
    weight_bytes = 2 * n * k
    copies = [w] + [w.clone() for _ in range(math.ceil(ROTATION_BYTES / weight_bytes) - 1)]
    op = _op(silu)

    t0 = time.perf_counter()
    record = decode_linear.tune(w, DTYPE, silu_mul=silu)
    torch.cuda.synchronize()
    report: dict[str, Any] = {
        "name": name,
        "tp": tp,
        "n": n,
        "k": k,
        "silu": silu,
        "copies": len(copies),
        "tune_s": round(time.perf_counter() - t0, 2),
        "tuning": {
            str(b): {
                "picked": c.backend.value,
                "config": str(c.config),
                "tune_triton_us": round(c.triton_us, 2),
                "tune_cublas_us": round(c.cublas_us, 2),
            }
            for b, c in record.items()
        },
    }
    rows = []
    for m in BATCHES:
        x = torch.randn(m, k, generator=gen, device=device).to(DTYPE)  # [M, K]
        ref = reference(x, w, silu)
        row: dict[str, Any] = {"m": m, "picked": record[m_bucket(m)].backend.value}
        for backend in BACKENDS:
            with decode_linear.forced_backend(backend):
                us = time_calls_us([partial(op, x, wi) for wi in copies])
                err = rel_err(op(x, w), ref)
            gbps = weight_bytes / (us * 1e-6) / 1e9
            row[backend.value] = {
                "us": round(us, 2),
                "weight_gbps": round(gbps, 1),
                "pct_of_copy": round(100 * gbps / copy_gbps, 1),
                "rel_err": float(f"{err:.3g}"),
            }
        row["triton_speedup"] = round(row["cublas"]["us"] / row["triton"]["us"], 3)
        # The pick comes from do_bench timings (eager, L2 flushed); this is the graph's verdict.
        row["faster_in_graph"] = "triton" if row["triton_speedup"] > 1 else "cublas"
        rows.append(row)
        print(
            f"{name:12s} TP{tp} {n:6d}x{k:<6d} M={m:2d}  "
            + "  ".join(
                f"{b.value} {row[b.value]['us']:8.2f} us ({row[b.value]['pct_of_copy']:5.1f}%)"
                for b in BACKENDS
            )
            + f"  x{row['triton_speedup']:.2f} picked {row['picked']}",
            flush=True,
        )
    report["batches"] = rows
    del copies
    torch.cuda.empty_cache()
    return report


def step_sums(shapes: list[dict[str, Any]]) -> dict[str, Any]:
    """Per TP and batch: 32 x (one layer's linears) + LM head, ms, for cublas, triton, picked."""
    by = {(s["name"], s["tp"]): s for s in shapes if "batches" in s}
    out: dict[str, Any] = {}
    for tp in (1, 2):
        names = (*LAYER, "lm_head")
        if not all((nm, tp) in by for nm in names):
            continue
        for m in BATCHES:
            sums = {"cublas": 0.0, "triton": 0.0, "picked": 0.0}
            for nm in names:
                row = next(r for r in by[(nm, tp)]["batches"] if r["m"] == m)
                count = LAYERS if nm in LAYER else 1
                sums["cublas"] += count * row["cublas"]["us"]
                sums["triton"] += count * row["triton"]["us"]
                sums["picked"] += count * row[row["picked"]]["us"]
            out[f"tp{tp}_m{m}"] = {f"{key}_ms": round(v / 1e3, 3) for key, v in sums.items()}
    return out


def markdown(shapes: list[dict[str, Any]], steps: dict[str, Any], copy_gbps: float) -> str:
    lines = [
        f"device copy {copy_gbps / 1e3:.2f} TB/s (read+write); % = weight bytes / time / copy",
        "",
        (
            "| linear | TP | N x K | M | cuBLAS us | % copy | Triton us | % copy "
            "| Triton speedup | picked | rel err cuBLAS | rel err Triton |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in shapes:
        if "batches" not in s:
            lines.append(f"| {s['name']} | {s['tp']} | failed: {s['error']} |")
            continue
        for r in s["batches"]:
            c, t = r["cublas"], r["triton"]
            lines.append(
                f"| {s['name']} | {s['tp']} | {s['n']} x {s['k']} | {r['m']} | {c['us']} | "
                f"{c['pct_of_copy']} | {t['us']} | {t['pct_of_copy']} | {r['triton_speedup']} | "
                f"{r['picked']} | {c['rel_err']:.2e} | {t['rel_err']:.2e} |"
            )
    if steps:
        lines += [
            "",
            "| 32 layers + LM head | cuBLAS ms | Triton ms | picked ms |",
            "|---|---|---|---|",
        ]
        for key, v in steps.items():
            lines.append(f"| {key} | {v['cublas_ms']} | {v['triton_ms']} | {v['picked_ms']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gemv.json")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tp", nargs="*", type=int, default=[1, 2], choices=[1, 2])
    args = parser.parse_args()
    t_start = time.perf_counter()
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    import triton

    copy_gbps = copy_bandwidth_gbps(device)
    print(f"{torch.cuda.get_device_name(device)}: device copy {copy_gbps:.0f} GB/s", flush=True)
    shapes: list[dict[str, Any]] = []
    for seed, name in enumerate(args.shapes):
        for tp in args.tp:
            (n, k), silu = SHAPES[name][tp - 1], SHAPES[name][2]
            try:
                shapes.append(bench_shape(name, tp, n, k, silu, copy_gbps, 10 * seed + tp))
            except Exception as exc:  # noqa: BLE001 - keep the other shapes' results
                traceback.print_exc()
                shapes.append({"name": name, "tp": tp, "n": n, "k": k, "error": repr(exc)})
                torch.cuda.empty_cache()
    steps = step_sums(shapes)
    table = markdown(shapes, steps, copy_gbps)
    report = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_gbps": round(copy_gbps, 1),
        "win_margin": decode_linear.WIN_MARGIN,
        "shapes": shapes,
        "steps": steps,
        "markdown": table,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    print(table)
    print(f"total {report['seconds']} s", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
