"""W4A16 / W8A16 matmul for decode-sized batches (CUDA, Triton): packed int4 (or int8) weights
dequantized in registers.

y[M, N] = x[M, K] @ W[N, K].T (+ bias[N]), x bf16/fp16, y in x's dtype, W in the internal layout of
shard/quantization/int_weights.py:
  qweight [N, K/2] uint8 (column 2j in the low nibble of byte j, 2j+1 in the high one), or for
  int8 (bits=8) [N, K] uint8,
  scales [N, G] and zeros [N, G] (float; zero points are small integers, or for GGUF Q4_1 / Q4_K
  fractional: int_zeros=False),
  w[n, k] = (q[n, k] - zeros[n, k // GROUP]) * scales[n, k // GROUP].

Why: at decode batch sizes a linear is a pass over its weight bytes; int4 halves fp8's bytes and
quarters bf16's, provided the unpacking stays in registers.

Design (a first version; block sizes and split-K are for the GPU session to tune):
- Each program owns BLOCK_N weight rows and loops over the whole K in tiles of BLOCK_K input
  features. A tile lies inside one group (the wrapper picks BLOCK_K dividing GROUP, or GROUP >= K),
  so each row's scale and zero are loaded once per tile, not per element.
- The tile's bytes [BLOCK_N, BLOCK_K/2] are split into their low and high nibbles and interleaved
  back into [BLOCK_N, BLOCK_K] (tl.join + reshape: column order 2j, 2j+1).
- q - zero is an integer in [-2^4, 2^4] (int8: [-256, 255]): exact in bf16 / fp16, so the tensor-core path multiplies
  x by (q - zero) in x's dtype and applies the scale to the [ROWS, BLOCK_N] partial sum in fp32
  (one multiply per output per tile instead of one per weight element).
- M == 1: CUDA cores (tl.sum of x * (q - zero)); 2 <= M <= 16: tl.dot with x padded to a 16-row
  tile (masked loads), as shard/kernels/gemv.py does for 16-bit and fp8 weights.

Not yet: CUDA-graph-safe autotuning per M bucket (gemv.py's tune_gemv), the decode dispatcher's
timed choice, split-K for small N, per-column g_idx (act-order slices whose groups
are unequal run the dequantizing path). The kernel runs under TRITON_INTERPRET=1 on CPU tensors
(tests/shard/test_triton_int_gemv_interpreter.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard.kernels.gemv_buckets import GEMV_MAX_M

__all__ = ["GEMV_MAX_M", "int4_gemv", "pick_block_k"]


@triton.jit
def _int4_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_ym,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    BITS: tl.constexpr,
    INT_ZEROS: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] weight rows / outputs
    row_mask = rows < N
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < M
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if BITS == 4:
            offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte columns of the tile
            packed = tl.load(
                q_ptr + rows[:, None] * stride_qn + offs_b[None, :],
                mask=row_mask[:, None] & (offs_b < K // 2)[None, :],
                other=0,
            )  # [BLOCK_N, BLOCK_K / 2] uint8
            lo = (packed & 0xF).to(tl.float32)
            hi = (packed >> 4).to(tl.float32)
            q = tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K])  # columns k0 + 2j, k0 + 2j + 1
        else:  # int8: one byte per value
            offs_q = k0 + tl.arange(0, BLOCK_K)
            q = tl.load(
                q_ptr + rows[:, None] * stride_qn + offs_q[None, :],
                mask=row_mask[:, None] & (offs_q < K)[None, :],
                other=0,
            ).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        g = k0 // GROUP  # the whole tile is in this group
        s = tl.load(s_ptr + rows * stride_sn + g, mask=row_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rows * stride_sn + g, mask=row_mask, other=0.0).to(tl.float32)
        wq = q - z[:, None]  # [BLOCK_N, BLOCK_K] integers in [-256, 255]: exact in bf16 / fp16
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & (offs_k < K)[None, :],
            other=0.0,
        )  # [ROWS, BLOCK_K]
        if USE_DOT and INT_ZEROS:
            part = tl.dot(x, tl.trans(wq.to(x.dtype)))  # [ROWS, BLOCK_N] fp32
        elif USE_DOT:
            # Fractional zero points (GGUF Q4_1 / Q4_K minimums): q - z is not exact in x's
            # dtype, q is; x @ (q - z).T = x @ q.T - sum_k(x) * z.
            xsum = tl.sum(x.to(tl.float32), axis=1)  # [ROWS]
            part = tl.dot(x, tl.trans(q.to(x.dtype))) - xsum[:, None] * z[None, :]
        else:
            part = tl.sum(x.to(tl.float32)[:, None, :] * wq[None, :, :], axis=2)
        acc += part * s[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + rows[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & row_mask[None, :])


def pick_block_k(group_size: int, in_features: int) -> int | None:
    """The largest K tile (<= 128, >= 16) inside one group, or None where none fits (the caller
    then dequantizes instead)."""
    for block_k in (128, 64, 32, 16):
        if group_size >= in_features or group_size % block_k == 0:
            return block_k
    return None


def int4_gemv(
    x: torch.Tensor,  # [M, K] bf16/fp16, 1 <= M <= GEMV_MAX_M
    qweight: torch.Tensor,  # [N, K/2] uint8 (int4) or [N, K] uint8 (int8, bits=8)
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor,  # [N, G], same strides as scales
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
    block_n: int = 32,
    block_k: int | None = None,
    num_warps: int = 4,
    bits: int = 4,
    int_zeros: bool = True,
) -> torch.Tensor:
    """y [M, N] = x @ dequant(qweight).T (+ bias), in x's dtype (W4A16, or W8A16 with bits=8).
    int_zeros: every zero point is an integer (False: GGUF Q4_1 / Q4_K's fractional ones, whose
    zero term the tensor-core path applies separately)."""
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.dtype != torch.uint8 or qweight.shape[1] * (8 // bits) != k or bits not in (4, 8):
        raise ValueError(f"int4_gemv: qweight {tuple(qweight.shape)} {qweight.dtype} does not "
                         f"hold {k} int{bits} input features")
    if m > GEMV_MAX_M:
        raise ValueError(f"int4_gemv: {m} rows, at most {GEMV_MAX_M}")
    block_k = block_k or pick_block_k(group_size, k)
    if block_k is None or (group_size < k and group_size % block_k):
        raise ValueError(f"int4_gemv: no K tile fits group size {group_size}")
    x = x.contiguous()
    scales, zeros = scales.contiguous(), zeros.contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    rows = 1 if m == 1 else 16
    _int4_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, qweight, scales, zeros, bias if bias is not None else scales, y,
        m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        GROUP=min(group_size, k) if group_size < k else k,
        ROWS=rows,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        HAS_BIAS=bias is not None,
        USE_DOT=rows > 1,
        BITS=bits,
        INT_ZEROS=int_zeros,
        num_warps=num_warps,
    )
    return y
