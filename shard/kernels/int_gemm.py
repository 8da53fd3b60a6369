"""Dequant-fused W4A16 / W8A16 GEMM for batches above the GEMV's 16 rows (CUDA, Triton): large
decode batches and prefill, without materializing a 16-bit copy of the weight.

y[M, N] = x[M, K] @ W[N, K].T (+ bias[N]), x bf16/fp16, y in x's dtype, W in the internal layout
of shard/quantization/int_weights.py (tile loads: shard/kernels/int_dequant.py).

Why: dequantizing the whole [N, K] weight to bf16 and then running cuBLAS writes and re-reads 4x
the int4 bytes, more than bf16 itself costs at decode sizes; at prefill sizes it is a fair
fallback, so it is one of the timed candidates.

Design:
- Output tiles [BLOCK_M, BLOCK_N], grouped along M (GROUP_M tiles of M share a column of weight
  tiles, so a weight tile is read from DRAM once and from L2 by its neighbours).
- Paths (GemmConfig.path, each a tuning candidate):
  "dq": per K tile the [BLOCK_N, BLOCK_K] weight tile in feature order (int_dequant.load_joined),
  dequantized in registers to x's dtype with one FMA per weight (int_dequant.scale_tile: exactly
  PackedInt.dequantize(x.dtype)'s rounding), x's tile one contiguous cp.async-pipelined load, and
  acc = dot(x, w.T, acc) (or the transpose, weight as the MMA's A operand): the accumulator stays
  in the MMA chain and the K loop pipelines (the structure of the Triton AWQ / GPTQ kernels).
  `words` candidates build the tile from int32 words instead of bytes (int_dequant.words_tile:
  fewer instructions per weight, which matters at 64..256 rows where dequantizing is ~half the
  work).
  "cublas": one kernel dequantizes the whole weight to x's dtype into a temporary (from the
  caching allocator: CUDA-graph safe, no host sync), then F.linear: for prefill sizes, where
  cuBLAS's tensor-core rate outweighs writing and re-reading the 16-bit weight.
  "offset" (the first version, slow: x read with stride-2 loads, a fresh MMA chain and an fp32
  correction per tile): the packed bytes split into low and high nibbles multiplied with x's
  even / odd columns as OFF + q made exact in x's dtype by bit operations, then
  acc += (part - sum(x) * (OFF + z)) * s; timed only for buckets up to 128 rows.
  "lop3" (32 / 64 rows, int4): int_gemv's lop3 tile with x padded to the bucket; "lop3z" the
  same unpack with the zero point subtracted in its inline PTX (shard/kernels/int_gemm_lop3.py:
  no row sums of x per step).
- Split-K ("dq", "lop3", "lop3z"; GemmConfig.split_k): the N = 4096 / 6144 shapes have too few
  output tiles at 32 / 64 rows to give every SM more than one program, and a K step of these
  tiles is a latency-bound chain (benchmarks/INT_KERNELS.md, "32 / 64 rows"): each K range its
  own program, fp32 partials and a per-tile arrival counter (int_tiles.finish).
- Tiles either lie inside one group or hold whole groups (int_dequant.tile_fits).
- Configs are chosen per M bucket (next power of two, 32..4096) by measured time at warm-up
  (shard/kernels/int_tuning.py), never while a CUDA graph is captured; launches pass the chosen
  config explicitly. M is not specialized on (do_not_specialize), so every M of a bucket runs
  the one compiled kernel that warm-up loaded.

Runs under TRITON_INTERPRET=1 on CPU tensors (tests/shard/test_triton_int_gemm_interpreter.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import triton
import triton.language as tl

from shard.kernels.int_dequant import (
    dequant,
    group_params,
    groups_per_tile,
    kernel_group,
    load_halves,
    load_joined,
    load_words,
    offset_ok,
    offset_weights,
    offset_zero,
    scale_tile,
    tile_fits,
    words_tile,
    x_kind,
)
from shard.kernels.int_tiles import finish, k_splits, split_workspace

__all__ = ["GEMM_M_BUCKETS", "GemmConfig", "candidates", "gemm_bucket", "int_gemm"]

# Tuning buckets of M (> GEMV_MAX_M): the next power of two, capped at the last.
GEMM_M_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def gemm_bucket(m: int) -> int:
    return min(max(1 << max(m - 1, 0).bit_length(), GEMM_M_BUCKETS[0]), GEMM_M_BUCKETS[-1])


@triton.jit(do_not_specialize=["M"])
def _int_gemm_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr,
    part_ptr,  # SPLIT_K > 1: [SPLIT_K, M, N] fp32 partial sums (int_tiles.finish)
    count_ptr,  # SPLIT_K > 1: [>= output tiles] int32 arrival counters, zero between launches
    M, N, K,
    K_SPLIT,  # input features per K split: a multiple of BLOCK_K
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
    DQ: tl.constexpr,  # GemmConfig.path "dq": weight tile dequantized to x's dtype, one MMA chain
    WORDS: tl.constexpr,  # GemmConfig.words ("dq", int4, NG 1): the tile built from int32 words
    SPLIT_K: tl.constexpr = 1,  # GemmConfig.split_k: K ranges per output tile (program_id(1))
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
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
    s, z = group_params(s_ptr, z_ptr, rows, row_mask, k_lo, k_hi, stride_sn, GROUP, NG)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        # the next tile's scales now (int_dequant.group_params: not pipelined otherwise; two
        # steps ahead through the loop's registers, Triton 3.6 / 3.9 stop pipelining the loop)
        s_next, z_next = group_params(s_ptr, z_ptr, rows, row_mask, k0 + BLOCK_K,
                                      k_hi, stride_sn, GROUP, NG)
        if DQ:
            # The standard W4A16 structure: the [BLOCK_N, BLOCK_K] weight tile in feature order,
            # dequantized in registers to x's dtype (exactly PackedInt.dequantize(x.dtype)'s
            # rounding), x's tile one contiguous load, and the accumulator carried through the
            # MMAs (acc = dot(a, b, acc): no per-tile fp32 epilogue, so the K loop pipelines).
            k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
            if WORDS:
                words = load_words(q_ptr, rows, row_mask, k0, K, stride_qn, BLOCK_K)
                w = words_tile(words, s, z, xt.dtype)  # [BLOCK_N, BLOCK_K]
            else:
                q = load_joined(q_ptr, rows, row_mask, k0, K, stride_qn, BLOCK_K, BITS)
                w = scale_tile(q, s, z, NG, BITS).to(xt.dtype)  # [BLOCK_N, BLOCK_K]
            if W_FIRST:
                acc = tl.dot(w, tl.trans(xt), acc)  # [BLOCK_N, BLOCK_M]
            else:
                acc = tl.dot(xt, tl.trans(w), acc)  # [BLOCK_M, BLOCK_N]
        else:
            qa, qb = load_halves(q_ptr, rows, row_mask, k0, K, stride_qn, BLOCK_K, BITS)
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
        s, z = s_next, z_next
    if W_FIRST:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    if SPLIT_K > 1:
        # this split's partial, the last of the output tile's splits to arrive adds them all
        # (its counter: tile pid_m * tiles_n + pid_n, reset to 0 for the next launch / replay)
        finish(acc, offs_m, m_mask, rows, row_mask, pid_n, pid_k, b_ptr, y_ptr, part_ptr,
               count_ptr + pid_m * tiles_n, M, N, stride_ym, BLOCK_M, BLOCK_N, SPLIT_K,
               HAS_BIAS)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + rows[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & row_mask[None, :])


@triton.jit
def _dequant_kernel(
    q_ptr, s_ptr, z_ptr, w_ptr,
    N, K,
    stride_qn, stride_sn,
    GROUP: tl.constexpr,
    NG: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BITS: tl.constexpr,
    WORDS: tl.constexpr,  # int4, NG 1, K % 32 == 0: read as int32 words (int_dequant.load_words)
):
    """w [N, K] (x's dtype) = (q - z) * s: one [BLOCK_N, BLOCK_K] tile per program."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    k0 = tl.program_id(1) * BLOCK_K
    s, z = group_params(s_ptr, z_ptr, rows, row_mask, k0, K, stride_sn, GROUP, NG)
    if WORDS:
        words = load_words(q_ptr, rows, row_mask, k0, K, stride_qn, BLOCK_K)
        w = words_tile(words, s, z, w_ptr.dtype.element_ty)  # [BLOCK_N, BLOCK_K]
    else:
        q = load_joined(q_ptr, rows, row_mask, k0, K, stride_qn, BLOCK_K, BITS)
        w = scale_tile(q, s, z, NG, BITS).to(w_ptr.dtype.element_ty)  # [BLOCK_N, BLOCK_K]
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + rows.to(tl.int64)[:, None] * K + k[None, :], w,
             mask=row_mask[:, None] & (k < K)[None, :])


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      group_size: int, k: int, dtype: torch.dtype, bits: int = 4,
                      block_n: int = 64, block_k: int = 128, warps: int = 4) -> torch.Tensor:
    """[N, K] in `dtype`: PackedInt.dequantize(dtype) in one kernel (a write of 2 bytes per
    weight instead of torch's several passes). The result comes from the caching allocator, so
    inside a CUDA-graph capture it lives in the graph's pool; no host sync."""
    n = qweight.shape[0]
    w = torch.empty(n, k, device=qweight.device, dtype=dtype)
    scales, zeros = scales.contiguous(), zeros.contiguous()
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight, scales, zeros, w, n, k, qweight.stride(0), scales.stride(0),
        GROUP=kernel_group(group_size, k), NG=groups_per_tile(block_k, group_size, k),
        BLOCK_N=block_n, BLOCK_K=block_k, BITS=bits,
        WORDS=(bits == 4 and k % 32 == 0 and qweight.stride(0) % 16 == 0
               and qweight.data_ptr() % 16 == 0
               and groups_per_tile(block_k, group_size, k) == 1),
        num_warps=warps,
    )
    return w


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
    # "offset": the weight tile as OFF + q in x's dtype, K split into even / odd halves and a
    # per-tile fp32 correction (the first version: slow, the accumulator leaves the MMA chain
    # every tile; kept as candidates for the 32..128 buckets where it was chosen).
    # "dq": the tile dequantized in registers to x's dtype, acc = dot(x, w.T, acc).
    # "cublas": the whole weight dequantized to x's dtype into a temporary (block_n x block_k
    # tiles), then F.linear: never slower than that at any M, as a timed candidate.
    path: str = "offset"
    # "dq", int4, tiles inside one group, K % 32 == 0: the tile built from int32 words
    # (int_dequant.words_tile: ~4 instructions per weight instead of the byte-wise ~9)
    words: bool = False
    # "lop3" (32 / 64 rows, int4, tiles inside one group): int_gemv's lop3 tile with x padded to
    # block_m rows, one program over all rows of the bucket (each weight unpacked once, PRMT /
    # LOP3). "lop3" and "dq": K split into split_k ranges, each its own program, the last to
    # finish adding the fp32 partials (int_tiles.finish): the N = 4096 / 6144 shapes have too
    # few output tiles to give every SM more than one program otherwise
    split_k: int = 1

    def as_dict(self) -> dict[str, int | bool | str]:
        return asdict(self)


# Shared memory per stage: BLOCK_M x BLOCK_K x 2 B of x + BLOCK_N x BLOCK_K / 2 B of int4 (the
# dequantized tile lives in registers, and goes through shared memory as the MMA's B operand).
# Small-M tiles for large decode batches (few M tiles: N must supply the programs), square ones
# for prefill. First in the list: the untuned default of every bucket (the interpreter tests).
_DQ = tuple(
    GemmConfig(bm, bn, bk, w, st, path="dq", w_first=wf)
    for bm, bn, bk, w, st, wf in (
        (32, 64, 128, 4, 4, False), (32, 128, 128, 4, 3, False), (32, 32, 128, 4, 4, False),
        (64, 64, 128, 4, 4, False), (64, 128, 64, 4, 4, False), (64, 128, 128, 4, 3, False),
        (64, 256, 64, 8, 3, False), (128, 128, 64, 8, 3, False), (128, 128, 128, 8, 3, False),
        (128, 256, 64, 8, 3, False), (128, 128, 64, 4, 4, False), (256, 128, 64, 8, 3, False),
        # a 32-wide tile for groups of 32 (GGUF Q4_0 / Q4_1 / Q4_K) and a 64-wide one for 64
        (64, 128, 32, 4, 4, False), (128, 128, 32, 8, 4, False),
        # weight as the MMA's A operand (from registers on Hopper), y.T tiles
        (32, 128, 128, 4, 3, True), (64, 128, 64, 4, 4, True), (128, 256, 64, 8, 3, True),
    )
)
# the same tiles built from int32 words (tiles inside one group: int_dequant.words_tile)
_DQ_WORDS = tuple(
    GemmConfig(bm, bn, bk, w, st, path="dq", w_first=wf, words=True)
    for bm, bn, bk, w, st, wf in (
        (32, 64, 128, 4, 4, False), (32, 128, 128, 4, 3, False), (64, 64, 128, 4, 4, False),
        (64, 128, 64, 4, 4, False), (64, 128, 128, 4, 3, False), (64, 256, 64, 8, 3, False),
        (128, 128, 64, 8, 3, False), (128, 128, 128, 8, 3, False), (128, 256, 64, 8, 3, False),
        (256, 128, 64, 8, 3, False), (32, 128, 128, 4, 3, True), (64, 128, 64, 4, 4, True),
    )
)
_OFFSET = tuple(
    GemmConfig(bm, bn, bk, w, st, x_split=xs, w_first=wf)
    for bm, bn, bk, w, st, xs, wf in (
        # the first version's choices in the 32 .. 128 buckets (H100, round 10)
        (32, 64, 128, 4, 4, False, False), (32, 128, 128, 4, 3, False, False),
        (32, 32, 128, 4, 4, False, False), (64, 32, 128, 4, 4, False, True),
    )
)
# dequantize then cuBLAS, bucket-independent: block_m unused, block_n x block_k the dequantizing
# kernel's tile, block_k the largest K tile that lines up with the groups (candidates)
_CUBLAS_TILES = ((32, 4), (64, 8))  # (block_n, warps)
# The "offset" path reads x with stride-2 loads that cannot be pipelined
# (tests/shard/test_int_kernels_sm90_ptx.py): timed only up to this bucket, where it was chosen.
_OFFSET_MAX_M = 128
_CONFIGS = (*_DQ, *_DQ_WORDS, *_OFFSET)

# The 32- and 64-row buckets (decode batches) have their own short list. Why (H100, 2026-11-28,
# benchmarks/INT_KERNELS.md "M = 64"): their K steps cost ~1-2.7 us each, latency- not
# bandwidth-bound. The chosen tiles ran 4 warps per program and 1-2 programs per SM (dq 64 x 64
# x 128: 96 programs for qkv, 94 KB of shared memory, 128 registers; lop3 64 x 64: 202
# registers), i.e. 1-2 warps per scheduler, each step one dependent chain of ~470-510 SASS
# instructions (dequantize or unpack -> shared store -> barrier -> wgmma -> wait -> rescale) at
# ~4 cycles apiece. So: more warps per scheduler (8-warp tiles; split-K for the dq path too,
# with stages 3 for 2-3 programs per SM), and fewer instructions per step (the "lop3z" tile,
# shard/kernels/int_gemm_lop3.py: no row sums of x per step). Kept from the older lists: the
# tiles that won or came within ~10 % of the winner at 32 / 64 rows on 2026-11-28.
# "dq": (block_m, block_n, block_k, warps, stages, words, split_k)
_SMALL_DQ = tuple(
    GemmConfig(bm, bn, bk, w, st, path="dq", words=wd, split_k=sk)
    for bm, bn, bk, w, st, wd, sk in (
        # kept (qkv 64 / gate_up 64 / o 32 winners or near them)
        (64, 64, 128, 4, 4, True, 1), (64, 128, 128, 4, 3, False, 1),
        (64, 128, 128, 4, 3, True, 1), (32, 32, 128, 4, 4, False, 1),
        # 8 warps: half the dequantizing chain per warp, 2 warps per scheduler
        (64, 64, 128, 8, 3, True, 1), (64, 128, 128, 8, 3, True, 1),
        # split-K: qkv 96 -> 192 / 384 programs, o / down 64 -> 128 / 256 at 64 x 64 (72 KB of
        # shared memory at stages 3: 3 programs per SM)
        (64, 64, 128, 4, 3, True, 2), (64, 64, 128, 4, 3, True, 4), (64, 128, 128, 8, 3, True, 2),
        (64, 64, 128, 8, 3, True, 4), (64, 64, 128, 8, 3, True, 2), (32, 64, 128, 4, 3, True, 4),
        # K tiles of 64 (half a group): x's stage 8 KB instead of 16, more programs per SM
        (64, 64, 64, 4, 4, True, 4),
    )
)
# "lop3": (block_n, block_k, warps, stages, split_k), block_m = the bucket (32 or 64)
# (sm_90 SASS per weight in the K loop at 64 rows: 256 x 128 / 8 warps ~4.2, 64 x 128 / 4 ~7.9,
# ~130 instructions a warp-step of them x's row sums)
_LOP3_TILES = ((256, 128, 8, 3, 1), (128, 128, 4, 3, 1), (128, 128, 4, 3, 4), (64, 128, 4, 3, 4))
# "lop3z" (shard/kernels/int_gemm_lop3.py: the zero subtracted in the unpack, no row sums):
# (block_n, block_k, warps, stages, split_k); sm_90 (Triton 3.6) at 64 rows: 64 x 128 /
# 4 warps ~300 SASS a warp-step (4.7 per weight; lop3: 508, 7.9), 157 registers, 3 programs
# per SM; 128 x 128 / 4 warps 3.6 per weight (lop3 5.3)
_LOP3Z_TILES = ((64, 128, 4, 3, 4), (128, 128, 4, 3, 4), (128, 128, 8, 3, 2),
                (64, 128, 8, 3, 4), (128, 128, 4, 3, 1), (64, 64, 4, 4, 8))
# (no stages-1 register-prefetch tiles here: at 64 rows they spill to local memory)
_LOP3_BUCKETS = (32, 64)


def candidates(m: int, group_size: int, in_features: int) -> list[GemmConfig]:
    """The candidates for a bucket of m rows whose K tiles line up with the groups (tiles taller
    than twice the bucket would mostly multiply padding), the dequantize-then-cuBLAS ones last;
    [] where no K tile lines up. The 32- and 64-row buckets: _SMALL_DQ and the lop3 tiles."""
    block_k = _largest_tile(group_size, in_features)
    if block_k is None:
        return []

    def fits(c: GemmConfig) -> bool:
        return (tile_fits(c.block_k, group_size, in_features)
                and (not c.words or (in_features % 32 == 0
                                     and groups_per_tile(c.block_k, group_size, in_features) == 1)))

    # (the short list was chosen for tiles inside one group: group 128 or per channel; smaller
    # groups keep the general list's tiles of 32 / 64 features)
    small = [c for c in _SMALL_DQ if m in _LOP3_BUCKETS and fits(c)
             and groups_per_tile(c.block_k, group_size, in_features) == 1
             and c.block_m <= max(2 * m, 32)]
    every = [c for c in _CONFIGS if fits(c)]
    if not every:  # e.g. group 32 with K not a multiple of 64: the largest tile that lines up
        every = [GemmConfig(bm, 64, block_k, 4, 3, path="dq") for bm in (32, 64, 128)]
    sized = [c for c in every if c.block_m <= max(2 * m, 32)
             and (c.path != "offset" or m <= _OFFSET_MAX_M)]
    lop3_ok = m in _LOP3_BUCKETS and in_features % 32 == 0
    tiles = [*((GemmConfig(m, bn, bk, w, st, path="lop3", split_k=sk)
                for bn, bk, w, st, sk in _LOP3_TILES)),
             *((GemmConfig(m, bn, bk, w, st, path="lop3z", split_k=sk)
                for bn, bk, w, st, sk in _LOP3Z_TILES))]
    lop3 = [c for c in tiles if lop3_ok and groups_per_tile(c.block_k, group_size, in_features) == 1
            and tile_fits(c.block_k, group_size, in_features)]
    return [*(small or sized or every), *lop3,
            *(GemmConfig(0, bn, block_k, w, 1, path="cublas") for bn, w in _CUBLAS_TILES)]


def _largest_tile(group_size: int, k: int) -> int | None:
    """The largest K tile (>= 32: the loads' alignment hint, int_dequant.load_halves) that lines
    up with the groups."""
    return next((bk for bk in (128, 64, 32) if tile_fits(bk, group_size, k)), None)


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
    counters: torch.Tensor | None = None,  # split-K: int32, zero, >= output tiles (else fresh)
    int_zeros: bool = True,  # every zero point an integer ("lop3z" needs it, else runs "lop3")
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
    if config.path in ("lop3", "lop3z"):
        if (bits == 4 and k % 32 == 0 and qweight.stride(0) % 16 == 0
                and qweight.data_ptr() % 16 == 0 and config.block_k >= 32
                and groups_per_tile(config.block_k, group_size, k) == 1
                and tile_fits(config.block_k, group_size, k)):
            from shard.kernels.int_gemv import GemvConfig, int4_gemv

            if config.path == "lop3z" and int_zeros:
                from shard.kernels.int_gemm_lop3 import lop3z_gemm

                # rows beyond the tile (a config used above its bucket): one launch per block_m
                return torch.cat([
                    lop3z_gemm(x[i:i + config.block_m], qweight, scales, zeros, group_size, bias,
                               config.block_m, config.block_n, config.block_k, config.warps,
                               config.stages, config.split_k, counters)
                    for i in range(0, m, config.block_m)]) if m else x.new_empty(0, n)

            tile = GemvConfig(config.block_n, config.block_k, config.warps, config.stages,
                              config.split_k, use_dot=True, lop3=True)
            # rows beyond the tile (a config used above its bucket): one launch per block_m
            return torch.cat([int4_gemv(x[i:i + config.block_m], qweight, scales, zeros,
                                        group_size, bias, bits=4, int_zeros=int_zeros,
                                        config=tile, counters=counters, rows=config.block_m)
                              for i in range(0, m, config.block_m)]) if m else x.new_empty(0, n)
        # not an int4 weight the tile reads: the dq tile of the same shape, whole K
        config = replace(config, path="dq", split_k=1)
    if config.path == "cublas":
        w = dequantize_weight(qweight, scales, zeros, group_size, k, x.dtype, bits,
                              config.block_n, config.block_k, config.warps)
        return torch.nn.functional.linear(x, w, bias)
    if config.block_k < 32:  # the loads' alignment hint (int_dequant.load_halves)
        raise ValueError(f"int_gemm: K tile {config.block_k} below 32")
    if config.words and (bits != 4 or k % 32 or qweight.stride(0) % 16 or qweight.data_ptr() % 16
                         or groups_per_tile(config.block_k, group_size, k) != 1):
        config = replace(config, words=False)  # the same tile, read byte-wise
    if not tile_fits(config.block_k, group_size, k):
        raise ValueError(f"int_gemm: K tile {config.block_k} does not fit group size "
                         f"{group_size} (K {k})")
    if x.stride(-1) != 1 or x.stride(0) != k or x.data_ptr() % 16:
        x = x.contiguous() if not x.is_contiguous() else x.clone()
    scales, zeros = scales.contiguous(), zeros.contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    split, k_split = k_splits(k, config.block_k, config.split_k if config.path == "dq" else 1)
    # (a config used above its bucket can have more output tiles than a linear's counters:
    # fresh zeroed ones, from the caching allocator, are as good)
    part, counters = split_workspace(split, m, n, tiles, counters, scales, "int_gemm", grow=True)
    _int_gemm_kernel[(tiles, split)](
        x, qweight, scales, zeros, bias if bias is not None else scales, y, part, counters,
        m, n, k, k_split,
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
        DQ=config.path == "dq",
        WORDS=config.words,
        SPLIT_K=split,
        num_warps=config.warps,
        num_stages=config.stages,
    )
    return y
