"""W4A16 decode GEMV (shard/kernels/int_gemv.py) vs bf16 on one GPU: correctness, a config sweep,
and the memory roofline of the int4 bytes (issue 40; < 3 minutes on an H100).

    python3 benchmarks/int4_gemv_check.py --out $OUT/int4_gemv.json

For the Llama-3-8B linear shapes (N x K: fused q/k/v 6144x4096, o 4096x4096, fused gate/up
28672x4096, down 4096x14336), random weights packed as W4A16 with group 128 (asymmetric: one
fp16 scale and one fp16 zero per group), batches M = 1, 2, 4, 8, 16:
  - check: the kernel vs an fp32 reference over the same dequantized weights (max error relative
    to the largest output; bf16 outputs: must be below 2^-6);
  - bf16: F.linear(x, W_bf16) (cuBLAS);
  - int4: every (BLOCK_N, BLOCK_K, num_warps) of a small sweep, the fastest kept (what the tuned
    dispatcher would pick);
  - batch 64 (prefill / large decode): IntLinear's current dequantize-then-F.linear path vs bf16,
    to size the dequant-fused GEMM still to be written.
Timing: mean over many calls cycling through enough weight copies to overflow L2 (a decode step
streams each layer's weight from HBM), after a warm-up, with CUDA events. Reported per shape and
batch: microseconds, GB/s of the int4 bytes (packed weight + scales + zeros) and % of a measured
device-to-device copy bandwidth (1 GiB copy_, read + write bytes), speedup vs bf16. Whole-layer
sums at the end (sum of the four linears per variant). Targets (issue 40): batch 1 >= 75 % of the
roofline of the int4 bytes and >= 2.5x bf16.
First, GGUF's Q4_1 / Q4_K layout (group 32, fractional zero points: the kernel's int_zeros=False
path) is checked against fp32 at every batch and timed beside the integer-zero path.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard.kernels.int_gemv import int4_gemv
from shard.quantization.int_weights import IntLinear, PackedInt, UnpackedInt

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BATCHES = (1, 2, 4, 8, 16)
GROUP = 128
SWEEP = list(itertools.product((16, 32, 64, 128), (64, 128), (2, 4, 8)))  # BLOCK_N, BLOCK_K, warps
L2_BYTES = 256 * 2**20  # copies cycled so that their bytes exceed any L2 (50 MiB on an H100)


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device copy, read + write."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * 2**30 * 10 / (start.elapsed_time(end) / 1e3) / 1e9


def time_us(fn, copies: int, iters: int = 200) -> float:
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn(i % copies)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def packed_weight(n: int, k: int) -> PackedInt:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(n, k // GROUP, device="cuda") * 0.02 + 0.001).half()
    zeros = torch.randint(0, 16, (n, k // GROUP), device="cuda").half()
    g_idx = torch.arange(k, device="cuda") // GROUP
    return PackedInt.pack(UnpackedInt(q, scales, zeros, g_idx, 4))


def gguf_q4_1_check(report: dict) -> None:
    """GGUF Q4_1 / Q4_K layouts (group 32, float16 scales, fractional float32 zero points):
    the kernel's int_zeros=False path against fp32, every batch, on the q/k/v shape, timed with
    the default config next to the integer-zero path on the same bytes."""
    n, k = SHAPES["qkv"]
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(n, k // 32, device="cuda") * 0.02 + 0.001).half()
    zeros = torch.rand(n, k // 32, device="cuda") * 30 - 15  # -min / d: not integers
    w = PackedInt.pack(UnpackedInt(q, scales, zeros, torch.arange(k, device="cuda") // 32, 4))
    ref_w = w.dequantize(torch.float32)
    rows = {}
    for m in BATCHES:
        x = torch.randn(m, k, device="cuda").bfloat16()
        ref = x.float() @ ref_w.t()
        y = int4_gemv(x, w.qweight, w.scales, w.zeros, 32, int_zeros=False)
        err = float((y.float() - ref).abs().max() / ref.abs().max())
        frac_us = time_us(lambda i, x=x: int4_gemv(x, w.qweight, w.scales, w.zeros, 32,
                                                   int_zeros=False), 1, iters=100)
        int_us = time_us(lambda i, x=x: int4_gemv(x, w.qweight, w.scales, w.zeros, 32), 1,
                         iters=100)
        rows[m] = {"max_err": err, "ok": err < 2**-6, "fractional_us": frac_us,
                   "integer_path_us": int_us}
        print(f"gguf q4_1 qkv M={m:2d}: err {err:.1e} fractional-zero path {frac_us:.1f} us, "
              f"integer-zero path {int_us:.1f} us (same bytes, L2-warm)")
    report["gguf_q4_1"] = rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    report: dict = {"device": torch.cuda.get_device_name(), "copy_GBps": bandwidth, "group": GROUP,
                    "shapes": {}}
    print(f"{report['device']}: copy {bandwidth:.0f} GB/s")
    gguf_q4_1_check(report)
    for name, (n, k) in SHAPES.items():
        w = packed_weight(n, k)
        int4_bytes = sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.zeros))
        copies = max(1, L2_BYTES // int4_bytes + 1)
        packs = [w] + [PackedInt(w.qweight.clone(), w.scales.clone(), w.zeros.clone(), 4, k,
                                 GROUP, None, None) for _ in range(copies - 1)]
        dense = w.dequantize(torch.bfloat16)
        bf16_copies = max(1, L2_BYTES // dense.nbytes + 1)
        denses = [dense] + [dense.clone() for _ in range(bf16_copies - 1)]
        rows = {}
        for m in BATCHES:
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = x.float() @ w.dequantize(torch.float32).t()
            y = int4_gemv(x, w.qweight, w.scales, w.zeros, GROUP)
            err = float((y.float() - ref).abs().max() / ref.abs().max())
            assert err < 2**-6, (name, m, err)
            bf16_us = time_us(lambda i, x=x, d=denses: F.linear(x, d[i]), bf16_copies)
            best = None
            for bn, bk, warps in SWEEP:
                def call(i: int, x: torch.Tensor = x, packs: list[PackedInt] = packs,
                         bn: int = bn, bk: int = bk, warps: int = warps) -> torch.Tensor:
                    p = packs[i]
                    return int4_gemv(x, p.qweight, p.scales, p.zeros, GROUP, block_n=bn,
                                     block_k=bk, num_warps=warps)
                try:
                    us = time_us(call, copies, iters=100)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile
                    print(f"  {name} M={m} config {(bn, bk, warps)}: {type(exc).__name__}")
                    continue
                if best is None or us < best[0]:
                    best = (us, (bn, bk, warps))
            us, cfg = best
            gbps = int4_bytes / (us / 1e6) / 1e9
            rows[m] = {"int4_us": us, "config": cfg, "bf16_us": bf16_us, "int4_GBps": gbps,
                       "pct_copy": 100 * gbps / bandwidth, "speedup": bf16_us / us, "max_err": err}
            print(f"{name:8s} M={m:2d} int4 {us:7.1f} us ({gbps:6.0f} GB/s, "
                  f"{100 * gbps / bandwidth:4.1f}% of copy) bf16 {bf16_us:7.1f} us "
                  f"x{bf16_us / us:.2f} cfg {cfg} err {err:.1e}")
        x64 = torch.randn(64, k, device="cuda").bfloat16()
        linear = IntLinear(w, use_gemv=False)
        rows[64] = {"dequant_linear_us": time_us(lambda i, f=linear, x=x64: f(x), 1, iters=50),
                    "bf16_us": time_us(lambda i, x=x64, d=denses: F.linear(x, d[i]),
                                       bf16_copies)}
        print(f"{name:8s} M=64 dequant+F.linear {rows[64]['dequant_linear_us']:.1f} us, "
              f"bf16 {rows[64]['bf16_us']:.1f} us")
        report["shapes"][name] = {"N": n, "K": k, "int4_bytes": int4_bytes,
                                  "bf16_bytes": dense.nbytes, "batches": rows}
        packs = denses = dense = linear = None
        torch.cuda.empty_cache()
    for m in BATCHES:
        int4 = sum(s["batches"][m]["int4_us"] for s in report["shapes"].values())
        bf16 = sum(s["batches"][m]["bf16_us"] for s in report["shapes"].values())
        print(f"layer M={m:2d}: int4 {int4:.1f} us, bf16 {bf16:.1f} us, x{bf16 / int4:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
