"""Batch-1 decode GEMV: every Triton config of a wider grid vs the tuned one, per weight shape.

    python3 benchmarks/gemv_config_sweep.py [--tp 2 1] [--fp8] --out $OUT/gemv_sweep.json
                                                                  (one GPU, ~1 min per dtype)

Why: shard/kernels/gemv.py autotunes among a handful of M == 1 configs, timing one call at a time
with the L2 cleared (triton.testing.do_bench). A decode step runs the GEMVs back to back inside a
CUDA graph, where a config's ramp-up and tail matter more; this script times a wider grid of
(BLOCK_N, BLOCK_K, warps, stages) the way gemv_check.py times backends (a graph of many calls
cycling through weight copies that overflow the L2) for the Llama-3-8B shapes at TP=2 and TP=1,
and reports, per shape, the tuned config's time and the best few of the grid. Only a config
that wins by more than the run-to-run spread is worth adding to the candidate lists.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8_gemv_check import time_calls_us  # this script's directory is on sys.path
from gemv_check import ROTATION_BYTES, SHAPES

from shard.kernels import gemv as gemv_kernel
from shard.layers.decode_linear import tune
from shard.quantization.fp8 import quantize_fp8_per_channel

SWEPT = ("qkv", "o", "gate_up_silu", "down")


def grid(weight_bytes: int) -> list:
    """Candidate M == 1 (CUDA-core) configs: 2 to 24 KB of weight in flight per program (fp8
    rows: twice the elements of bf16 ones for the same bytes)."""
    out = []
    ks = (256, 512, 1024) if weight_bytes == 2 else (512, 1024, 2048)
    for block_n, block_k, warps, stages, prefetch in itertools.product(
        (2, 4, 8, 16), ks, (4, 8), (1, 3, 4), (False, True)
    ):
        in_flight = block_n * block_k * weight_bytes * max(stages - 1, 1)
        if not 2048 <= in_flight <= 24576 or (stages == 1 and block_k < 512):
            continue
        if prefetch and stages != 1:  # (the register double buffer is the STAGES=1 loop's)
            continue
        out.append(gemv_kernel._config(block_n, block_k, warps, stages, False, prefetch))
    return out


def sweep_shape(name: str, n: int, k: int, silu: bool, fp8: bool, device: torch.device) -> dict:
    w = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)  # [N, K]
    scale = None
    if fp8:
        w, scale = quantize_fp8_per_channel(w)  # [N, K] fp8, [N] fp32
    size = w.element_size() * n * k
    copies = [w] + [w.clone() for _ in range(max(2, math.ceil(ROTATION_BYTES / size)) - 1)]
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)  # [1, K]
    if fp8:
        tuned_config = gemv_kernel.tune_gemv(w, scale, None, torch.bfloat16, silu_mul=silu)[1]
        pick = "triton"
    else:
        tuned = tune(w, torch.bfloat16, silu_mul=silu)[1]
        tuned_config, pick = tuned.config, tuned.backend.value

    def timed(config) -> float:
        return time_calls_us([
            lambda wi=wi: gemv_kernel.gemv(x, wi, scale, silu_mul=silu, config=config)
            for wi in copies
        ])

    rows = []
    for config in grid(w.element_size()):
        try:
            rows.append((timed(config), str(config)))
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: skip the config
            rows.append((float("inf"), f"{config}: {type(exc).__name__}"))
    rows.sort()
    return {"shape": name, "n": n, "k": k, "silu_mul": silu, "fp8": fp8,
            "tuned_config": str(tuned_config), "tuned_us": timed(tuned_config), "pick": pick,
            "best": rows[:6], "candidates": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gemv_sweep.json")
    parser.add_argument("--tp", nargs="*", type=int, default=[2], choices=[1, 2])
    parser.add_argument("--fp8", action="store_true", help="fp8 weights (per-channel scales)")
    args = parser.parse_args()
    device = torch.device("cuda")
    results = []
    for tp in args.tp:
        for name in SWEPT:
            tp1, tp2, silu = SHAPES[name]
            n, k = tp1 if tp == 1 else tp2
            row = sweep_shape(name, n, k, silu, args.fp8, device)
            row["tp"] = tp
            results.append(row)
            print(f"TP={tp} {'fp8 ' if args.fp8 else ''}{name} {n}x{k}: tuned "
                  f"{row['tuned_us']:.2f} us "
                  f"({row['tuned_config']}); best {row['best'][:3]}", flush=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                          "results": results}, indent=1))


if __name__ == "__main__":
    main()
