"""One-kernel dynamic per-token int8 quantization of activations (CUDA, Triton), for the W8A8-int8
linears (shard/quantization/w8a8.py).

Why: the torch form (w8a8.quantize_per_token: float cast, abs, amax, clamp, divide, divide,
round, clamp, cast) is ~9 kernels per call; at Llama-3-8B shapes their launches cost more than
the int8 GEMM they feed (benchmarks/raw/round10/w8a8/w8a8.log: ~250 us of a 300 us layer). Here
one program per row reads the row twice (absmax, then quantize) in one launch.

Bit-equal to quantize_per_token (the CPU reference), step by step:
  - absmax in float32 (exact: a max of the inputs' absolute values, widened exactly);
  - scale = max(absmax, 1e-12) / 127 with IEEE round-to-nearest division (tl.math.div_rn; a plain
    `/` compiles to an approximate division on CUDA);
  - q = round-half-to-even(x / scale) with div_rn again, then clamped to [-127, 127]. torch.round
    rounds halves to even; Triton's interpreter has no libdevice, so the rounding is the fp32
    trick (v + 1.5 * 2^23) - 1.5 * 2^23, exact round-half-even for |v| < 2^22 (after the clamp,
    |v| <= 127), the same on the interpreter and on the GPU (IEEE adds, no fast-math reassociation).

Imported only where Triton is (the kernel also runs under TRITON_INTERPRET=1 on CPU tensors:
tests/shard/test_triton_w8a8_interpreter.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

QMAX = tl.constexpr(127.0)
# 1.5 * 2^23: in fp32, v + this keeps no fraction bits (rounded half to even), for |v| < 2^22
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit(do_not_specialize=["M"])
def _quant_int8_per_token_kernel(
    x_ptr,  # [M, K] bf16/fp16/fp32, rows stride_x apart, unit column stride
    q_ptr,  # [M, K] int8, contiguous
    s_ptr,  # [M] float32
    M,
    K,
    stride_x,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        mask = start + offs < K
        x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), QMAX)
    tl.store(s_ptr + row, scale)
    q_row = q_ptr + row * K
    for start in range(0, K, BLOCK):
        mask = start + offs < K
        x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.clamp(tl.math.div_rn(x, scale), -QMAX, QMAX)
        v = (v + _ROUND_MAGIC) - _ROUND_MAGIC  # round half to even, as torch.round
        tl.store(q_row + start + offs, v.to(tl.int8), mask=mask)


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (int8 [M, K] contiguous, scale [M] float32): w8a8.quantize_per_token in
    one launch, bit-equal to it. No host sync (CUDA-graph safe once compiled)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_int8_per_token: x must be [M, K], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m and k:
        block = min(2048, triton.next_power_of_2(k))
        warps = 4 if block <= 1024 else 8
        _quant_int8_per_token_kernel[(m,)](x, q, scale, m, k, x.stride(0), BLOCK=block,
                                           num_warps=warps)
    elif m:
        scale.fill_(1e-12 / QMAX.value)
    return q, scale
