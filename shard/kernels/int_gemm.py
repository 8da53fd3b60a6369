"""Dequant-fused W4A16 / W8A16 GEMM for batches above the GEMV's 16 rows (CUDA, Triton): large
decode batches and prefill, without materializing a 16-bit copy of the weight.

y[M, N] = x[M, K] @ W[N, K].T (+ bias[N]), x bf16/fp16, y in x's dtype, W in the internal layout
of shard/quantization/int_weights.py (tile loads: shard/kernels/int_dequant.py).

Why: the alternative (IntLinear's CPU path) dequantizes the whole [N, K] weight to bf16 on every
call and then runs cuBLAS: it writes and re-reads 4x the int4 bytes, more than bf16 itself costs.

Design:
- Output tiles [BLOCK_M, BLOCK_N], grouped along M (GROUP_M tiles of M share a column of weight
  tiles, so a weight tile is read from DRAM once and from L2 by its neighbours).
- Per K tile: the packed bytes [BLOCK_N, BLOCK_K / 2] split into low and high nibbles (features
  k0 + 2j and k0 + 2j + 1), multiplied with x's matching even / odd columns by tl.dot. A tile
  inside one group takes the weights as OFF + q, made exact in x's dtype by OR-ing q into the
  mantissa of a power of two (int_dequant.offset_weights: no int-to-float conversion, a
  quarter-rate instruction on Hopper), and corrects the [BLOCK_M, BLOCK_N] partial product in
  fp32: acc += (part - sum(x) * (OFF + z)) * s, i.e. exact weights, fractional zero points
  (GGUF Q4_1 / Q4_K) included. Tiles of several groups (and int8 weights with bf16 x) dequantize
  in fp32 and round the weight to x's dtype, as PackedInt.dequantize(x.dtype) does.
- Tiles either lie inside one group or hold whole groups (int_dequant.tile_fits).
- Configs are chosen per M bucket (next power of two, 32..4096) by measured time at warm-up
  (shard/kernels/int_tuning.py), never while a CUDA graph is captured; launches pass the chosen
  config explicitly. M is not specialized on (do_not_specialize), so every M of a bucket runs
  the one compiled kernel that warm-up loaded.

Runs under TRITON_INTERPRET=1 on CPU tensors (tests/shard/test_triton_int_gemm_interpreter.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from shard.kernels.int_dequant import (
    dequant,
    group_params,
    groups_per_tile,
    kernel_group,
    load_halves,
    offset_ok,
    offset_weights,
    offset_zero,
    tile_fits,
    x_kind,
)

__all__ = ["GEMM_M_BUCKETS", "GemmConfig", "candidates", "gemm_bucket", "int_gemm"]

# Tuning buckets of M (> GEMV_MAX_M): the next power of two, capped at the last.
GEMM_M_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def gemm_bucket(m: int) -> int:
    return min(max(1 << max(m - 1, 0).bit_length(), GEMM_M_BUCKETS[0]), GEMM_M_BUCKETS[-1])


@triton.jit(do_not_specialize=["M"])
def _int_gemm_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_ym,
    GROUP: tl.constexpr,
    NG: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BITS: tl.constexpr,
    X_SPLIT: tl.constexpr,  # int4: x loaded contiguously and split (else two strided loads)
    W_FIRST: tl.constexpr,  # the weight tile as the dot's A operand: y.T tiles = W @ x.T
    X_KIND: tl.constexpr,  # int_dequant.x_kind: fp16 1, bf16 2
    OFFSET: tl.constexpr,  # int_dequant.offset_ok: weights made exact in x's dtype by bit ops
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M consecutive programs walk down M over the same weight columns (L2 reuse).
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows = output columns
    row_mask = rows < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    if W_FIRST:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y's tile transposed
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        qa, qb = load_halves(q_ptr, rows, row_mask, k0, K, stride_qn, BLOCK_K, BITS)
        s, z = group_params(s_ptr, z_ptr, rows, row_mask, k0, stride_sn, GROUP, NG)
        if BITS == 4 and X_SPLIT:
            # one contiguous (vectorized) load, split into even / odd features in registers
            k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
            xa, xb = tl.split(tl.reshape(xt, [BLOCK_M, BLOCK_K // 2, 2]))
        elif BITS == 4:
            k_even = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            xa = tl.load(x_rows + k_even[None, :], mask=m_mask[:, None] & (k_even < K)[None, :],
                         other=0.0)  # [BLOCK_M, BLOCK_K / 2]: even features
            xb = tl.load(x_rows + k_even[None, :] + 1,
                         mask=m_mask[:, None] & (k_even + 1 < K)[None, :], other=0.0)  # odd
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            xa = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
            xb = xa
        if NG == 1 and OFFSET:
            # One group per tile: x @ (OFF + q).T on tensor cores (weights made exact in x's
            # dtype by bit operations, no conversion instructions), then per output column
            # (part - sum(x) * (OFF + z)) * s in fp32: [BLOCK_M, BLOCK_N] work per tile.
            xsum = tl.sum(xa.to(tl.float32), axis=1)  # [BLOCK_M]
            if BITS == 4:
                xsum += tl.sum(xb.to(tl.float32), axis=1)
            s1 = tl.reshape(s, [BLOCK_N])
            zo = offset_zero(tl.reshape(z, [BLOCK_N]), BITS, X_KIND)  # OFF + z
            if W_FIRST:
                part = tl.dot(offset_weights(qa, BITS, X_KIND), tl.trans(xa))  # [BLOCK_N, BLOCK_M]
                if BITS == 4:
                    part = tl.dot(offset_weights(qb, BITS, X_KIND), tl.trans(xb), part)
                acc += (part - zo[:, None] * xsum[None, :]) * s1[:, None]
            else:
                part = tl.dot(xa, tl.trans(offset_weights(qa, BITS, X_KIND)))  # [BLOCK_M, BLOCK_N]
                if BITS == 4:
                    part = tl.dot(xb, tl.trans(offset_weights(qb, BITS, X_KIND)), part)
                acc += (part - xsum[:, None] * zo[None, :]) * s1[None, :]
        elif W_FIRST:
            acc = tl.dot(dequant(qa, s, z, NG).to(xa.dtype), tl.trans(xa), acc)
            if BITS == 4:
                acc = tl.dot(dequant(qb, s, z, NG).to(xb.dtype), tl.trans(xb), acc)
        else:
            # Several groups per tile (or int8 with bf16 x): the weight dequantized in fp32 and
            # rounded to x's dtype, as PackedInt.dequantize(x.dtype) rounds it.
            acc = tl.dot(xa, tl.trans(dequant(qa, s, z, NG).to(xa.dtype)), acc)
            if BITS == 4:
                acc = tl.dot(xb, tl.trans(dequant(qb, s, z, NG).to(xb.dtype)), acc)
    if W_FIRST:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + rows[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & row_mask[None, :])


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration (a tuning candidate)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    group_m: int = 8
    # int4: x's tile loaded contiguously (16-byte vectors) and split into even / odd features in
    # registers, instead of two stride-2 loads; which is faster depends on the layout shuffle
    # the split costs: measured, like the rest.
    x_split: bool = False
    # The dequantized weight tile as the MMA's first operand (y.T = W @ x.T, transposed once at
    # the end): Hopper's wgmma takes A from registers but B only from shared memory, so the
    # in-register weight can feed it directly this way round.
    w_first: bool = False

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# Shared memory per stage: BLOCK_M x BLOCK_K x 2 B of x + BLOCK_N x BLOCK_K / 2 B of int4 (the
# dequantized tile lives in registers). Small-M tiles for large decode batches (few M tiles: N
# must supply the programs), square ones for prefill.
_CONFIGS = (
    *(GemmConfig(bm, bn, bk, w, st)
      for bm, bn, bk, w, st in (
          (32, 64, 128, 4, 4), (32, 128, 128, 4, 3), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4),
          (64, 128, 128, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 64, 128, 4, 3),
          # a 32-wide tile: the conversion-free path for groups of 32 (GGUF Q4_0 / Q4_1 / Q4_K)
          (64, 128, 32, 4, 4),
          # narrow N tiles for large decode batches on N = 4096 shapes (o_proj, down_proj): with
          # one M tile, BLOCK_N 64 gives only 64 programs for 132 SMs, 32 gives 128
          (32, 32, 128, 4, 4), (64, 32, 128, 4, 4),
      )),
    *(GemmConfig(bm, bn, bk, w, st, x_split=True)
      for bm, bn, bk, w, st in ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3))),
    *(GemmConfig(bm, bn, bk, w, st, x_split=xs, w_first=True)
      for bm, bn, bk, w, st, xs in (
          (64, 128, 128, 4, 3, False), (128, 128, 64, 8, 3, False), (128, 256, 64, 8, 3, True),
          (64, 32, 128, 4, 4, False),
      )),
)


def candidates(m: int, group_size: int, in_features: int) -> list[GemmConfig]:
    """The candidates for a bucket of m rows whose K tiles line up with the groups (tiles taller
    than twice the bucket would mostly multiply padding)."""
    fits = [c for c in _CONFIGS if tile_fits(c.block_k, group_size, in_features)]
    if not fits:  # e.g. group 32 with K not a multiple of 64: the largest tile that lines up
        block_k = next((bk for bk in (128, 64, 32)  # >= 32: an int4 half-tile is the dot's K
                        if tile_fits(bk, group_size, in_features)), None)
        fits = [] if block_k is None else [GemmConfig(bm, 64, block_k, 4, 3)
                                           for bm in (32, 64, 128)]
    sized = [c for c in fits if c.block_m <= max(2 * m, 32)]
    return sized or fits


def default_config(m: int, group_size: int, in_features: int) -> GemmConfig:
    pool = candidates(m, group_size, in_features)
    if not pool:
        raise ValueError(f"int_gemm: no K tile fits group size {group_size} (K {in_features})")
    return pool[0]


def int_gemm(
    x: torch.Tensor,  # [M, K] bf16/fp16
    qweight: torch.Tensor,  # [N, K/2] uint8 (int4) or [N, K] uint8 (int8, bits=8)
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor,  # [N, G], same strides as scales
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
    bits: int = 4,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """y [M, N] = x @ dequant(qweight).T (+ bias) in x's dtype; config: a tuned candidate (None:
    the first candidate of M's bucket)."""
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.dtype != torch.uint8 or bits not in (4, 8) or qweight.shape[1] * (8 // bits) != k:
        raise ValueError(f"int_gemm: qweight {tuple(qweight.shape)} {qweight.dtype} does not "
                         f"hold {k} int{bits} input features")
    if config is None:
        config = default_config(gemm_bucket(m), group_size, k)
    if config.block_k < 32:  # the loads' alignment hint (int_dequant.load_halves)
        raise ValueError(f"int_gemm: K tile {config.block_k} below 32")
    if not tile_fits(config.block_k, group_size, k):
        raise ValueError(f"int_gemm: K tile {config.block_k} does not fit group size "
                         f"{group_size} (K {k})")
    if x.stride(-1) != 1 or x.stride(0) != k or x.data_ptr() % 16:
        x = x.contiguous() if not x.is_contiguous() else x.clone()
    scales, zeros = scales.contiguous(), zeros.contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _int_gemm_kernel[grid](
        x, qweight, scales, zeros, bias if bias is not None else scales, y,
        m, n, k,
        k, qweight.stride(0), scales.stride(0), n,
        GROUP=kernel_group(group_size, k),
        NG=groups_per_tile(config.block_k, group_size, k),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        STAGES=config.stages,
        HAS_BIAS=bias is not None,
        BITS=bits,
        X_SPLIT=config.x_split,
        W_FIRST=config.w_first,
        X_KIND=x_kind(x.dtype),
        OFFSET=offset_ok(bits, x_kind(x.dtype)),
        num_warps=config.warps,
        num_stages=config.stages,
    )
    return y
