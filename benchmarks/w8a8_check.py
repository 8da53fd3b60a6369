"""W8A8-int8 linears (shard/quantization/w8a8.py: per-token int8 activations, torch._int_mm) vs
bf16 on one GPU, Llama-3-8B shapes (issue 40: batch 256 faster than bf16; < 2 minutes on an H100).

    python3 benchmarks/w8a8_check.py --out $OUT/w8a8.json

For the linear shapes (N x K: fused q/k/v 6144x4096, o 4096x4096, fused gate/up 28672x4096,
down 4096x14336), random int8 weights with per-channel scales, batches M = 1, 16, 64, 256, 1024:
  - check: W8A8Linear on CUDA vs the same layer on CPU (the exact int32 reference, float64
    rescale) for M = 1 (padded to 17 rows for cuBLASLt) and 256: max error relative to the
    largest output (bf16 output rounding: below 2^-7);
  - time: W8A8Linear.forward (activation quantization + int8 GEMM + rescale, all of it) and
    its int8 GEMM alone against F.linear with the bf16 weight; CUDA events, mean over calls
    cycling through weight copies that overflow L2.
Prints one line per shape and batch and the whole-layer sums; writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard.quantization.int_weights import UnpackedInt
from shard.quantization.w8a8 import W8A8Linear, int8_matmul, quantize_per_token

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BATCHES = (1, 16, 64, 256, 1024)
L2_BYTES = 256 * 2**20


def layer(n: int, k: int, device: str) -> W8A8Linear:
    g = torch.Generator().manual_seed(n * 7 + k)
    q = torch.randint(1, 256, (n, k), generator=g, dtype=torch.int16).to(torch.uint8)  # int8+128
    scales = (torch.rand(n, 1, generator=g) * 1e-3 + 1e-4)
    w = UnpackedInt(q, scales, torch.full_like(scales, 128.0), torch.zeros(k, dtype=torch.int64), 8)
    return W8A8Linear(w).to(device)


def timed(fn, calls: int) -> float:
    """Mean microseconds per call (CUDA events, after a warm-up)."""
    for _ in range(3):
        fn(0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(calls):
        fn(i)
    end.record()
    torch.cuda.synchronize()
    return 1000.0 * start.elapsed_time(end) / calls


def check(name: str, n: int, k: int) -> list[dict]:
    """W8A8Linear on CUDA vs the same layer on CPU (exact int32 sums), M = 1 and 256."""
    cpu, gpu = layer(n, k, "cpu"), layer(n, k, "cuda")
    rows = []
    for m_rows in (1, 256):
        x = torch.randn(m_rows, k).to(torch.bfloat16)
        got = gpu(x.to("cuda")).double().cpu()
        want = cpu(x.float()).double()  # the same bf16 inputs
        err = float((got - want).abs().max() / want.abs().max())
        rows.append({"shape": name, "check_m": m_rows, "rel_err": err, "ok": err < 2**-7})
        print(f"check {name} M={m_rows}: rel err {err:.2e}", flush=True)
    return rows


def time_shape(name: str, n: int, k: int, calls: int) -> list[dict]:
    copies = max(1, L2_BYTES // (n * k) + 1)
    gpu = [layer(n, k, "cuda") for _ in range(copies)]
    w_bf16 = [m.dequantized_weight(torch.bfloat16) for m in gpu]
    rows = []
    for m_rows in BATCHES:
        x = torch.randn(m_rows, k, device="cuda", dtype=torch.bfloat16)
        xq, _ = quantize_per_token(x)
        t_bf16 = timed(lambda i, x=x: F.linear(x, w_bf16[i % copies]), calls)
        t_w8a8 = timed(lambda i, x=x: gpu[i % copies](x), calls)
        t_mm = timed(lambda i, xq=xq: int8_matmul(xq, gpu[i % copies].qweight), calls)
        rows.append({"shape": name, "n": n, "k": k, "m": m_rows, "bf16_us": t_bf16,
                     "w8a8_us": t_w8a8, "int8_mm_us": t_mm, "speedup": t_bf16 / t_w8a8})
        print(f"{name:8s} M={m_rows:5d}: bf16 {t_bf16:8.1f} us  w8a8 {t_w8a8:8.1f} us "
              f"(int8 GEMM alone {t_mm:8.1f})  speedup {t_bf16 / t_w8a8:.2f}x", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    checks, rows = [], []
    for name, (n, k) in SHAPES.items():
        checks += check(name, n, k)
        rows += time_shape(name, n, k, args.calls)
        torch.cuda.empty_cache()
    totals = {}
    for m_rows in BATCHES:
        bf16 = sum(r["bf16_us"] for r in rows if r["m"] == m_rows)
        w8a8 = sum(r["w8a8_us"] for r in rows if r["m"] == m_rows)
        totals[m_rows] = {"bf16_us": bf16, "w8a8_us": w8a8, "speedup": bf16 / w8a8}
        print(f"layer M={m_rows:5d}: bf16 {bf16:8.1f} us  w8a8 {w8a8:8.1f} us  speedup "
              f"{bf16 / w8a8:.2f}x  (target at 256: > 1)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "checks": checks,
                                        "rows": rows, "layer_totals": totals}, indent=2) + "\n")


if __name__ == "__main__":
    main()
