"""W4A16 / W8A16 matmul for decode-sized batches (CUDA, Triton): packed int4 (or int8) weights
dequantized in registers.

y[M, N] = x[M, K] @ W[N, K].T (+ bias[N]), x bf16/fp16, y in x's dtype, W in the internal layout of
shard/quantization/int_weights.py (see shard/kernels/int_dequant.py for the tile loads):
  w[n, k] = (q[n, k] - zeros[n, k // GROUP]) * scales[n, k // GROUP].

Why: at decode batch sizes a linear is a pass over its weight bytes; int4 quarters bf16's bytes,
provided the unpacking stays in registers.

Design:
- A program owns BLOCK_N weight rows and one of SPLIT_K contiguous K ranges (whole BLOCK_K tiles).
  SPLIT_K > 1 is for shapes with few rows per SM (o_proj / down_proj, N = 4096 on 132 SMs: with
  BLOCK_N 16 only ~2 programs per SM keep too few bytes in flight): each split stores its fp32
  partial sums to a workspace, then bumps the row block's counter; the program that finds itself
  last adds the partials, applies the bias, writes y and resets the counter to 0 (so the next
  launch, or the next replay of a CUDA graph, starts from zero). One kernel, no zero-fill or
  reduction launch. The counters are a small persistent int32 buffer owned by the caller
  (IntLinear), zeroed once.
- Tiles inside one group (GROUP a multiple of BLOCK_K): no int-to-float conversion per weight
  (cvt runs at a quarter of the FP32 rate on Hopper; two per int4 byte would cap the stream near
  60 % of HBM bandwidth). Each nibble is OR-ed into the mantissa of a power of two OFF whose ulp
  is 1, giving OFF + q exactly (int_dequant.offset_weights): in fp32 for M == 1 (CUDA cores:
  sum_k x_k (OFF + q_k)), in x's dtype for 2 <= M <= 16 (tensor cores, x padded to the MMA's 16
  rows with masked loads: x @ (OFF + q).T). Per row and tile the fp32 partial sum then becomes
  s * (part - (OFF + z) * sum_k x_k): exact products, a cancellation of ~4-7 of fp32's 24 bits,
  and fractional zero points (GGUF Q4_1 / Q4_K) need nothing else. int8 weights with bf16 x
  (128 + q does not fit bf16's significand) multiply x by (q - z), exact in bf16, instead.
- Tiles of several groups (BLOCK_K a multiple of GROUP, e.g. GROUP 32): the tile is dequantized
  in fp32 per group ((q - z) * s), then reduced (M == 1) or cast to x's dtype for the dot.
- Loads: 16-byte vectors of packed bytes along K (contiguous, evict-first: read once), software
  pipelined over STAGES through tl.range (cp.async). `join` candidates re-interleave the nibbles
  in registers so that x's tile is one contiguous pipelined load too (the halves form reads x
  with stride-2 loads that stall every K step); scales and zeros are loaded one K step ahead.
  Batch 1's `words` candidates read the packed row as int32 words (_words_row_product): the
  CUDA-core dot is ALU-bound otherwise (~9 instructions per weight byte-wise, ~5 this way).

Candidates (`candidates`, per batch bucket) are picked by measured time at warm-up, never during a
CUDA-graph capture (shard/kernels/int_tuning.py). The kernel runs under TRITON_INTERPRET=1 on CPU
tensors (tests/shard/test_triton_int_gemv_interpreter.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import triton
import triton.language as tl

from shard.kernels import int_gemv_wide
from shard.kernels.gemv_buckets import GEMV_MAX_M
from shard.kernels.int_dequant import (
    dequant,
    group_params,
    groups_per_tile,
    kernel_group,
    load_halves,
    load_joined,
    offset_ok,
    offset_weights,
    offset_zero,
    tile_fits,
    x_kind,
)
from shard.kernels.int_tiles import finish, k_splits, lop3_tile, split_workspace

__all__ = ["GEMV_MAX_M", "GemvConfig", "candidates", "int4_gemv", "pick_block_k"]


@triton.jit
def _x_halves(x_ptr, offs_m, m_mask, k0, K, stride_xm, BLOCK_K: tl.constexpr, BITS: tl.constexpr):
    """x's columns matching load_halves: int4 -> (even features k0 + 2j, odd k0 + 2j + 1), each
    [ROWS, BLOCK_K / 2]; int8 -> the [ROWS, BLOCK_K] tile twice."""
    if BITS == 4:
        k_even = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        base = x_ptr + offs_m[:, None] * stride_xm
        xe = tl.load(base + k_even[None, :], mask=m_mask[:, None] & (k_even < K)[None, :],
                     other=0.0)
        xo = tl.load(base + k_even[None, :] + 1,
                     mask=m_mask[:, None] & (k_even + 1 < K)[None, :], other=0.0)
        return xe, xo
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                     mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
        return xt, xt


@triton.jit
def _tile_product(xh, qh, s, z, USE_DOT: tl.constexpr, INT_ZEROS: tl.constexpr,
                  NG: tl.constexpr, BITS: tl.constexpr, X_KIND: tl.constexpr,
                  OFFSET: tl.constexpr):
    """[ROWS, BLOCK_N] fp32: xh [ROWS, C] @ dequant(qh [BLOCK_N, C] integers).T, scaled."""
    if NG == 1:
        s1 = tl.reshape(s, [s.shape[0]])  # [BLOCK_N]
        z1 = tl.reshape(z, [z.shape[0]])
        xf = xh.to(tl.float32)
        if USE_DOT:
            if OFFSET:
                # x @ (OFF + q).T - sum(x) * (OFF + z): no int-to-float conversion per weight
                v = offset_weights(qh, BITS, X_KIND)  # [BLOCK_N, C] exact in x's dtype
                part = tl.dot(xh, tl.trans(v)) - (tl.sum(xf, axis=1)[:, None]
                                                  * offset_zero(z1, BITS, X_KIND)[None, :])
            elif INT_ZEROS:  # int8 with bf16 x: q - z in [-255, 255] is exact in bf16
                part = tl.dot(xh, tl.trans((qh.to(tl.float32) - z1[:, None]).to(xh.dtype)))
            else:
                part = (tl.dot(xh, tl.trans(qh.to(tl.float32).to(xh.dtype)))
                        - tl.sum(xf, axis=1)[:, None] * z1[None, :])
        else:
            v = offset_weights(qh, BITS, 0)  # [BLOCK_N, C]: OFF + q in fp32
            part = (tl.sum(v * xf, axis=1)[None, :]
                    - tl.sum(xf, axis=1)[:, None] * offset_zero(z1, BITS, 0)[None, :])
        return part * s1[None, :]
    else:
        w = dequant(qh, s, z, NG)  # [BLOCK_N, C] fp32
        if USE_DOT:
            return tl.dot(xh, tl.trans(w.to(xh.dtype)))
        else:
            return tl.sum(w * xh.to(tl.float32), axis=1)[None, :]


@triton.jit
def _nibble_dot(words, xi, I: tl.constexpr):
    """sum_c x[8c + I] * (128 + nibble I of words[:, c]) -> [BLOCK_N] fp32."""
    v = (((words >> (4 * I)) & 0xF) << 16 | (134 << 23)).to(tl.float32, bitcast=True)
    return tl.sum(v * xi[None, :], axis=1)


@triton.jit
def _words_row_product(x_ptr, q_ptr, s, z, rows, row_mask, k0, K, stride_qn,
                       BLOCK_K: tl.constexpr):
    """Batch 1, int4, a tile inside one group: [1, BLOCK_N] fp32 = s * (sum_k x_k (OFF + q_k) -
    (OFF + z) * sum_k x_k), the packed bytes read as int32 words (8 nibbles each: nibble i of
    word c is feature 8c + i, little-endian), so each weight costs a constant shift and one
    LOP3 ((w << 16 - 4i) & 0xF0000 | OFF's exponent) instead of a byte extract, a zero
    extension and two shifts (the byte-wise tile compiled to ~9 instructions per weight on
    sm_90, ALU-bound below the memory rate)."""
    w_ptr = q_ptr.to(tl.pointer_type(tl.int32))
    offs_w = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, BLOCK_K // 8), 4),
                               BLOCK_K // 8)  # word columns (16-byte aligned runs)
    words = tl.load(w_ptr + rows.to(tl.int64)[:, None] * (stride_qn // 4) + offs_w[None, :],
                    mask=row_mask[:, None] & (offs_w < K // 8)[None, :], other=0,
                    eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K / 8] int32
    # x's tile [BLOCK_K / 8, 8] (one contiguous load), split into the 8 nibble positions
    k3 = k0 + 8 * tl.arange(0, BLOCK_K // 8)[:, None] + tl.arange(0, 8)[None, :]
    x3 = tl.load(x_ptr + k3, mask=k3 < K, other=0.0).to(tl.float32)  # [BLOCK_K / 8, 8]
    xsum = tl.sum(tl.sum(x3, axis=1), axis=0)
    ev, od = tl.split(tl.reshape(x3, [BLOCK_K // 8, 4, 2]))  # nibbles 0 2 4 6 / 1 3 5 7
    e04, e26 = tl.split(tl.reshape(ev, [BLOCK_K // 8, 2, 2]))
    o15, o37 = tl.split(tl.reshape(od, [BLOCK_K // 8, 2, 2]))
    x0, x4 = tl.split(e04)
    x2, x6 = tl.split(e26)
    x1, x5 = tl.split(o15)
    x3_, x7 = tl.split(o37)
    part = _nibble_dot(words, x0, 0) + _nibble_dot(words, x1, 1)
    part += _nibble_dot(words, x2, 2) + _nibble_dot(words, x3_, 3)
    part += _nibble_dot(words, x4, 4) + _nibble_dot(words, x5, 5)
    part += _nibble_dot(words, x6, 6) + _nibble_dot(words, x7, 7)  # [BLOCK_N]
    s1 = tl.reshape(s, [s.shape[0]])
    z1 = tl.reshape(z, [z.shape[0]])
    return ((part - xsum * (z1 + 128.0)) * s1)[None, :]


@triton.jit
def _lop3_loads(x_ptr, q_ptr, rows, row_mask, offs_m, m_mask, k0, k_hi, K, stride_xm,
                stride_qn, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, PAST: tl.constexpr):
    """The tile at k0: int32 words [BLOCK_N, BLOCK_K / 8] (16-byte vectors: the row starts are
    computed in bytes, 16-byte aligned rows, which keeps their alignment visible to the
    compiler) and x [ROWS, BLOCK_K]. EVEN: no row or K tail, unpredicated weight loads. PAST: k0
    may lie past the range (a prefetch one step ahead): nothing is read there."""
    offs_w = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, BLOCK_K // 8), 4),
                               BLOCK_K // 8)
    w_rows = (q_ptr + rows.to(tl.int64) * stride_qn).to(tl.pointer_type(tl.int32))
    k = k0 + tl.arange(0, BLOCK_K)
    if EVEN:
        if PAST:  # one predicate for the whole tile (constant along K: 16-byte vectors stay)
            live_w = (tl.zeros([BLOCK_K // 8], tl.int32) + k0) < k_hi
            live_k = (tl.zeros([BLOCK_K], tl.int32) + k0) < k_hi
            words = tl.load(w_rows[:, None] + offs_w[None, :], mask=live_w[None, :], other=0,
                            eviction_policy="evict_first")
            xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                         mask=m_mask[:, None] & live_k[None, :], other=0.0)
        else:
            words = tl.load(w_rows[:, None] + offs_w[None, :], eviction_policy="evict_first")
            xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                         mask=m_mask[:, None], other=0.0)
    else:
        live = (k < k_hi) & (k < K)
        live_w = (offs_w < K // 8) & (offs_w * 8 < k_hi)
        words = tl.load(w_rows[:, None] + offs_w[None, :],
                        mask=row_mask[:, None] & live_w[None, :], other=0,
                        eviction_policy="evict_first")
        xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                     mask=m_mask[:, None] & live[None, :], other=0.0)
    return words, xt


@triton.jit
def _lop3_k_loop(x_ptr, q_ptr, s_ptr, z_ptr, rows, row_mask, offs_m, m_mask, k_lo, k_hi, K,
                 stride_xm, stride_qn, stride_sn, GROUP: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                 X_KIND: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr):
    """int4, tiles inside one group, 1..16 rows of x (padded to ROWS = 16; 32 / 64 for
    int_gemm's "lop3" path): the K loop of the lop3 tile, [ROWS, BLOCK_N] fp32. Weights are the
    MMA's first operand (BLOCK_N rows: Hopper's wgmma with the unpacked tile from registers),
    x's tile the second: per tile acc^T += s * ((OFF + q) @ x^T - (OFF + z) * sum_k x).
    STAGES > 1: Triton's pipeliner streams the tiles through shared memory (cp.async); STAGES 1:
    the next tile is loaded into registers one step ahead instead (no shared-memory round trip
    of the weights: fewer instructions per weight, one tile in flight per program)."""
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    s, z = group_params(s_ptr, z_ptr, rows, row_mask, k_lo, k_hi, stride_sn, GROUP, 1)
    if STAGES == 1:
        words, xt = _lop3_loads(x_ptr, q_ptr, rows, row_mask, offs_m, m_mask, k_lo, k_hi, K,
                                stride_xm, stride_qn, BLOCK_K, EVEN, True)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        s_next, z_next = group_params(s_ptr, z_ptr, rows, row_mask, k0 + BLOCK_K, k_hi,
                                      stride_sn, GROUP, 1)
        if STAGES == 1:
            words_next, xt_next = _lop3_loads(x_ptr, q_ptr, rows, row_mask, offs_m, m_mask,
                                              k0 + BLOCK_K, k_hi, K, stride_xm, stride_qn,
                                              BLOCK_K, EVEN, True)
        else:
            words, xt = _lop3_loads(x_ptr, q_ptr, rows, row_mask, offs_m, m_mask, k0, k_hi, K,
                                    stride_xm, stride_qn, BLOCK_K, EVEN, False)
        v = lop3_tile(words, X_KIND, ASM)  # [BLOCK_N, BLOCK_K]
        part = tl.dot(v, tl.trans(xt))  # [BLOCK_N, ROWS]
        xsum = tl.sum(xt.to(tl.float32), axis=1)  # [ROWS]
        s1 = tl.reshape(s, [BLOCK_N])
        z1 = tl.reshape(z, [BLOCK_N])
        acc += (part - offset_zero(z1, 4, X_KIND)[:, None] * xsum[None, :]) * s1[:, None]
        s, z = s_next, z_next
        if STAGES == 1:
            words, xt = words_next, xt_next
    return tl.trans(acc)


@triton.jit(do_not_specialize=["M"])
def _int_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr,
    part_ptr,  # SPLIT_K > 1: [SPLIT_K, M, N] fp32 workspace
    count_ptr,  # SPLIT_K > 1: [>= cdiv(N, BLOCK_N)] int32, zero between launches
    M, N, K,
    K_SPLIT,  # input features per split: a multiple of BLOCK_K
    stride_xm, stride_qn, stride_sn, stride_ym,
    GROUP: tl.constexpr,
    NG: tl.constexpr,  # groups per tile (1: the tile lies inside one group)
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    BITS: tl.constexpr,
    INT_ZEROS: tl.constexpr,
    X_KIND: tl.constexpr,  # int_dequant.x_kind: fp16 1, bf16 2
    OFFSET: tl.constexpr,  # int_dequant.offset_ok: weights made exact in x's dtype by bit ops
    JOIN: tl.constexpr,  # GemvConfig.join: the int4 tile re-interleaved, x loaded contiguously
    WORDS: tl.constexpr,  # GemvConfig.words: batch 1, int4, NG 1: packed bytes as int32 words
    LOP3: tl.constexpr = False,  # GemvConfig.lop3: int4, NG 1, ROWS 16 (_lop3_k_loop)
    ASM: tl.constexpr = False,  # LOP3's unpack as inline PTX (False: the interpreter's form)
    EVEN: tl.constexpr = False,  # LOP3: N % BLOCK_N == 0 and K % BLOCK_K == 0 (no tail masks)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] weight rows / outputs
    row_mask = rows < N
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < M
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    if LOP3:
        acc = _lop3_k_loop(x_ptr, q_ptr, s_ptr, z_ptr, rows, row_mask, offs_m, m_mask, k_lo,
                           k_hi, K, stride_xm, stride_qn, stride_sn, GROUP, ROWS, BLOCK_N,
                           BLOCK_K, STAGES, X_KIND, ASM, EVEN)
    else:
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        s, z = group_params(s_ptr, z_ptr, rows, row_mask, k_lo, k_hi, stride_sn, GROUP, NG)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            # the next tile's scales now (int_dequant.group_params: not pipelined otherwise)
            s_next, z_next = group_params(s_ptr, z_ptr, rows, row_mask, k0 + BLOCK_K,
                                          k_hi, stride_sn, GROUP, NG)
            if WORDS:
                acc += _words_row_product(x_ptr, q_ptr, s, z, rows, row_mask, k0, K, stride_qn,
                                          BLOCK_K)
            elif JOIN or BITS == 8:
                # one [BLOCK_N, BLOCK_K] tile in feature order and x's [ROWS, BLOCK_K] tile as one
                # contiguous (vectorized, cp.async-pipelined) load: no stride-2 loads of x
                q = load_joined(q_ptr, rows, row_mask, k0, K, stride_qn, BLOCK_K, BITS)
                k = k0 + tl.arange(0, BLOCK_K)
                xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                             mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
                acc += _tile_product(xt, q, s, z, USE_DOT, INT_ZEROS, NG, BITS, X_KIND, OFFSET)
            else:
                qa, qb = load_halves(q_ptr, rows, row_mask, k0, K, stride_qn, BLOCK_K, BITS)
                xa, xb = _x_halves(x_ptr, offs_m, m_mask, k0, K, stride_xm, BLOCK_K, BITS)
                acc += _tile_product(xa, qa, s, z, USE_DOT, INT_ZEROS, NG, BITS, X_KIND, OFFSET)
                acc += _tile_product(xb, qb, s, z, USE_DOT, INT_ZEROS, NG, BITS, X_KIND, OFFSET)
            s, z = s_next, z_next
    finish(acc, offs_m, m_mask, rows, row_mask, pid_n, pid_k, b_ptr, y_ptr, part_ptr, count_ptr,
           M, N, stride_ym, ROWS, BLOCK_N, SPLIT_K, HAS_BIAS)


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration (a tuning candidate)."""

    block_n: int
    block_k: int  # input features per tile (int4: BLOCK_K / 2 bytes per row)
    warps: int
    stages: int  # wide / diag tiles: 0 = one tile at a time in registers, 1 = double buffer
    split_k: int = 1
    use_dot: bool = False  # tensor cores (x padded to 16 rows); always for M > 1
    # int4: the tile's nibbles re-interleaved in registers (tl.join) and x loaded as one
    # contiguous tile, instead of even / odd halves with two stride-2 loads of x per tile
    join: bool = False
    # batch 1, int4, tiles inside one group, K a multiple of 32: the packed row read as int32
    # words, ~4 instructions per weight instead of ~9 (_words_row_product)
    words: bool = False
    # int4, tiles inside one group, K a multiple of 32, 1..16 rows: words unpacked by PRMT + LOP3
    # (inline PTX on CUDA), the weight tile as the MMA's first operand (_lop3_k_loop)
    lop3: bool = False
    # int4 tiles of several whole groups (shard/kernels/int_gemv_wide.py): BLOCK_K 256..2048
    # features, i.e. 128 B - 1 KB of each row per K step. wide: batch 1 on CUDA cores; diag:
    # 1..16 rows on the tensor cores (lop3 unpack, x as a group-diagonal MMA operand).
    wide: bool = False
    diag: bool = False
    # programmatic dependent launch (wide / diag tiles): the first weight tile loads during the
    # previous kernel's tail
    pdl: bool = False
    # wide / diag tiles: > 0 runs the persistent form, this many programs per SM looping over
    # the (row block, K split) units with the next tile always in flight (int_gemv_wide.py)
    persist: int = 0
    # wide / diag tiles: > 0 caps the registers per thread (ptxas .maxnreg) so that more programs
    # fit an SM (more bytes in flight); only where the sm_90 compile showed no spills
    maxnreg: int = 0
    # wide tiles, stages 0 / 1, gridded: x's planes / the scales loaded and the nibbles unpacked by
    # inline PTX in the words' layout (int_gemv_wide._ptx_k_loop: no layout conversion or
    # barrier in the K loop, one LOP3 a weight); 2: the scaling once per 4 words, not per word
    ptx: int = 0

    def as_dict(self) -> dict[str, int | bool]:
        return asdict(self)


# Batch 1, CUDA cores. The fast path needs a tile inside one group (BLOCK_K dividing GROUP: 64 or
# 128 for group 128), so bytes in flight come from rows and stages instead: BLOCK_N x BLOCK_K / 2
# bytes per stage (int4), STAGES - 1 stages ahead (cp.async into shared memory). The first
# version's tiles (32 x 64 B x 3 = 6 KB per program) reached 24 % of copy bandwidth on H100 with
# x's stride-2 loads in the loop; the `join` ones load x contiguously and keep 8-16 KB per stage
# in flight (128-256 rows x 64 B). Split-K 2 / 4 multiplies the programs of the N = 4096 shapes
# (o_proj, down_proj). The 256 / 512-wide tiles serve per-channel weights (one group per row) and
# hold several groups otherwise (the slower dequantizing path: measured like the rest).
# Batch-1 word tiles: x's split costs a fixed amount per tile, so more rows per thread pay off
# (sm_90 SASS per weight: 128 rows x 8 warps ~7.9, 256 x 8 ~5.6, 256 x 4 ~5.0; the byte-wise join
# tile ~8.8); split-K up to 8 gives the N = 4096 shapes enough programs.
_WORDS = tuple(
    GemvConfig(bn, bk, w, st, sk, words=True)
    for bn, bk, w, st, sk in (
        # batch-1 fallbacks where no multi-group tile applies (per-channel weights, K not a
        # multiple of 256, groups that are not a power of two): pruned to the tiles that were
        # the family's 1st / 2nd on some Llama-3-8B linear (H100, /work/data14/int4_b1_h100);
        # the first stays first (int_tuning's untuned default); 256 x 32 for groups of 32
        (256, 128, 8, 3, 1), (256, 128, 8, 3, 8), (256, 128, 8, 3, 2), (128, 128, 8, 3, 8),
        (128, 128, 8, 3, 4), (64, 128, 4, 4, 4), (256, 32, 8, 6, 1),
    )
)
_FMA = (
    # batch 1 only, the fallbacks for what the word / wide tiles do not take (K % 32 != 0, int8
    # weights, groups of 64 at BLOCK_K 128): pruned to the family's 1st / 2nd on some Llama
    # linear (H100), plus the 64-wide tile for groups of 64 and the 32-wide one for groups of 32
    *(GemvConfig(bn, bk, w, st, sk, join=True)
      for bn, bk, w, st, sk in (
          (128, 128, 8, 3, 4), (256, 128, 8, 3, 4), (256, 128, 8, 3, 1), (128, 64, 4, 4, 2),
          (64, 32, 4, 6, 1),
      )),
    # the first version's halves tiles (x read with stride-2 loads): its best at batch 1, and
    # the 256 / 512-wide tiles for per-channel weights
    *(GemvConfig(bn, bk, w, st, sk)
      for bn, bk, w, st, sk in (
          (64, 128, 4, 3, 1), (32, 128, 4, 4, 4), (128, 128, 8, 3, 4),
          (8, 256, 4, 3, 1), (16, 512, 4, 2, 1),
          # a 32-wide tile: the conversion-free path for groups of 32 (GGUF Q4_0 / Q4_1 / Q4_K)
          (64, 32, 4, 6, 1),
      )),
)
# 2 <= M <= 16 (and one batch-1 candidate): tensor cores, m16n8k16 needs BLOCK_N >= 16 and an
# int4 half-tile (the dot's K) of >= 16 features.
_DOT = (
    *(GemvConfig(bn, bk, w, st, sk, use_dot=True, join=True)
      for bn, bk, w, st, sk in (
          (32, 128, 4, 4, 1), (64, 128, 4, 4, 1), (128, 128, 8, 3, 1), (32, 128, 4, 4, 2),
          (64, 128, 4, 4, 2), (32, 128, 4, 4, 4), (64, 128, 4, 3, 4), (128, 128, 8, 3, 4),
          (64, 32, 4, 6, 1),
      )),
    *(GemvConfig(bn, bk, w, st, sk, use_dot=True)
      for bn, bk, w, st, sk in (
          (32, 128, 4, 4, 1), (32, 128, 4, 4, 2), (32, 256, 4, 3, 1), (64, 32, 4, 6, 1),
      )),
)


# The join tensor-core candidates timed at batch 1 too: none since the H100 sweep of the Llama-3-8B
# linears (the best, 64 x 128, 2.6x slower than the wide tile on qkv and 1.3x the word tile).
_DOT_FOR_M1 = 0

# 1..16 rows, int4 (x padded to 16 rows, one compiled kernel for every bucket): the lop3 tiles.
# sm_90 SASS per weight in the K loop (128 x 128 tile, 4 warps / 256 x 128, 8 warps): ~3.1 / 2.8
# (cp.async stages), against ~5.0-5.6 for the batch-1 word tiles and ~7.4 for the joined
# tensor-core tiles (tests/shard/test_int_kernels_sm90_ptx.py counts them). Split-K up to 8 for
# the N = 4096 shapes.
_LOP3 = tuple(
    GemvConfig(bn, bk, w, st, sk, use_dot=True, lop3=True)
    for bn, bk, w, st, sk in (
        (128, 128, 4, 3, 1), (128, 128, 4, 4, 1), (256, 128, 8, 3, 1), (64, 128, 4, 4, 1),
        (128, 128, 4, 3, 2), (128, 128, 4, 3, 4), (64, 128, 4, 4, 4), (128, 128, 4, 3, 8),
        (64, 128, 4, 4, 8), (256, 128, 8, 3, 4), (128, 64, 4, 4, 2), (64, 32, 4, 6, 1),
        # stages 1: the next tile prefetched into registers instead (_lop3_k_loop): ~2.5 SASS
        # per weight at 256 x 128 / 8 warps, one tile in flight per program
        (256, 128, 8, 1, 1), (256, 128, 8, 1, 4), (128, 128, 4, 1, 1), (128, 128, 4, 1, 4),
        (64, 128, 4, 1, 8),
    )
)
# Batch 1 times only the two lop3 tiles that came within 5 % of the word tiles (the fallbacks
# where no wide tile applies) on some Llama linear (H100): o / down 64 x 128 split-K 8, qkv
# 64 x 128 split-K 4.
_LOP3_B1 = (GemvConfig(64, 128, 4, 1, 8, use_dot=True, lop3=True),
            GemvConfig(64, 128, 4, 4, 4, use_dot=True, lop3=True))


# Several K tiles' bytes per row in flight (int_gemv_wide.py; benchmarks/INT_KERNELS.md, "W4A16
# batch 1: more bytes per row in flight", has the arithmetic). Llama-3-8B at batch 1: N = 4096
# (o, down) / 6144 (qkv) / 28672 (gate/up), 132 SMs. A program's tile is BLOCK_N x BLOCK_K / 2
# bytes (+ NG x 4 bytes of scales and zeros per row); STAGES 1 keeps two tiles in flight per
# program (register double buffer). The bf16 GEMV's winner (2 rows x 1024 of bf16: 4 KB a tile,
# ~16 programs per SM) is 4 rows x 2048 features here; 8-16 rows x 1024 give 4-8 KB tiles with
# the x planes shared by more rows per thread; split-K 2-4 gives o / qkv >= ~4 programs per SM
# with 16 KB tiles. (block_n, block_k, warps, stages, split_k)
_WIDE = tuple(
    GemvConfig(bn, bk, w, st, sk, wide=True, pdl=True)
    for bn, bk, w, st, sk in (
        # pruned to those within 15 % of the best on some Llama-3-8B linear (H100 sweep,
        # /work/data14/int4_b1_h100): st 1 = register double buffer
        (4, 2048, 4, 1, 1), (8, 1024, 4, 1, 1), (16, 1024, 4, 1, 1), (8, 2048, 4, 1, 1),
        (32, 512, 4, 1, 1), (16, 1024, 4, 1, 4), (32, 1024, 4, 1, 4), (16, 1024, 4, 3, 1),
        # stages 0: one tile at a time, no register prefetch (int_gemv_wide.py)
        (16, 1024, 4, 0, 1), (32, 512, 4, 0, 1), (8, 2048, 4, 0, 1), (16, 2048, 4, 0, 1),
        (32, 1024, 4, 0, 4),
    )
) + (GemvConfig(16, 1024, 4, 1, 1, wide=True),) + tuple(  # PDL off: the sweep's on / off pair
    # persistent: (block_n, block_k, warps, split_k, programs per SM); ~128 registers (3.6):
    # 4 programs of 128 threads fit an SM, ~212 for 32 rows: 2 (down_proj's 1st / 3rd)
    GemvConfig(bn, bk, w, 1, sk, wide=True, pdl=True, persist=ps)
    for bn, bk, w, sk, ps in ((16, 1024, 4, 4, 4), (32, 1024, 4, 2, 2), (16, 1024, 4, 2, 4))
) + tuple(
    # registers capped at 96 (no spills under Triton 3.6): 5 programs of 128 threads per SM
    # instead of 4 (gate_up's best)
    GemvConfig(bn, bk, 4, 0, sk, wide=True, pdl=True, maxnreg=96)
    for bn, bk, sk in ((16, 1024, 1), (8, 2048, 1), (16, 1024, 4))
)
# The wide tile's inline-PTX form (GemvConfig.ptx, int_gemv_wide._ptx_k_loop; stages 0 / 1,
# gridded, PDL): no layout conversion in the K loop, one LOP3 a nibble, 11 instructions a word
# to unpack. sm_90 SASS per weight under Triton 3.6 (the device's; `benchmarks/
# int4_sm90_loads.py --b1 4096` prints them all): 3.6 with 16 words a thread (4 rows x 4 word
# columns, or 1-2 rows x 8-16 columns) at 120-128 registers (4 programs of 128 threads per SM),
# 3.7 capped at 96 (5 per SM), 4.1 at 64 (8, spills); 3.4 with 32 words a thread (167
# registers, 3 per SM); the Triton form 4.6-5.2 at 125-168. Tiles: the measured winners' shapes
# (qkv 16 x 2048, o / down 8 x 2048, gate_up 16 x 1024), one-shot rows for K = 4096 (4 x 4096:
# one K step a program), a 256-thread 32 x 2048, 2-warp 8 x 1024, and split-K 2 for o / down.
_WIDE_PTX = tuple(
    GemvConfig(bn, bk, w, 0, sk, wide=True, pdl=True, ptx=True, maxnreg=mr)
    for bn, bk, w, sk, mr in (
        (16, 1024, 4, 1, 0), (16, 1024, 4, 1, 96), (16, 1024, 4, 1, 64), (8, 2048, 4, 1, 0),
        (16, 2048, 4, 1, 0), (8, 1024, 2, 1, 0), (4, 4096, 4, 1, 0), (32, 2048, 8, 1, 0),
        (8, 2048, 4, 2, 0),
    )
) + tuple(
    # stages 1: the next tile's words prefetched into registers (two tiles a program in
    # flight); 16 words a thread: 3.9 SASS per weight at 160 registers (3 programs per SM),
    # capped at 128 (4 per SM: 64 KB in flight against st 0's 4-5 x 8 KB)
    GemvConfig(bn, bk, w, 1, 1, wide=True, pdl=True, ptx=True, maxnreg=mr)
    for bn, bk, w, mr in ((16, 1024, 4, 0), (16, 1024, 4, 128))
) + tuple(
    # ptx 2: the 4 words a thread holds (one group) summed before the scaling, 2 FFMA per 4 words
    # instead of per word: under Triton 3.6 16 x 1024 / 8 x 2048 3.54 SASS per weight at 96
    # registers (5 programs per SM; ptx 1: 3.61 at 120-128), 16 x 2048 3.28 at 128, stages 1
    # 3.68 at 128 (ptx 1: 3.88 at 160); Triton 3.9 sums x's runs across lanes (a shuffle and a
    # barrier a K step: 3.4-3.8)
    GemvConfig(bn, bk, w, st, 1, wide=True, pdl=True, ptx=2, maxnreg=mr)
    for bn, bk, w, st, mr in ((16, 1024, 4, 0, 0), (8, 2048, 4, 0, 0), (16, 2048, 4, 0, 0),
                              (32, 1024, 4, 0, 0), (8, 4096, 4, 0, 0), (16, 1024, 4, 0, 80),
                              (16, 1024, 4, 1, 0), (8, 2048, 4, 1, 0))
)


# Tensor cores, 1..16 rows (x' rows = bucket x NG <= 32: BLOCK_K 256 serves every bucket, 512
# up to 8 rows). sm_90 compiles (Triton 3.6) of 16-64K-weight tiles: 2.3-3.3 SASS per weight,
# 130-255 registers (larger tiles spill: the unpacked tile and the double-buffered words are
# register resident), 40-150 KB of shared memory (x' and the MMA's staged weight operand).
_DIAG = tuple(
    GemvConfig(bn, bk, w, st, sk, use_dot=True, diag=True, pdl=True)
    for bn, bk, w, st, sk in (
        (64, 256, 4, 1, 1), (128, 256, 8, 1, 1), (64, 512, 8, 1, 1), (64, 256, 4, 1, 4),
        (128, 256, 8, 1, 4), (64, 512, 8, 1, 4), (64, 256, 4, 3, 2), (64, 512, 8, 1, 8),
        (128, 256, 8, 0, 1), (64, 256, 4, 0, 1), (128, 256, 8, 0, 4), (128, 512, 8, 0, 1),
        (128, 256, 4, 0, 1),
    )
) + (GemvConfig(64, 512, 8, 1, 1, use_dot=True, diag=True),) + tuple(
    # persistent (block_n, block_k, warps, split_k, programs per SM): 128 x 256 / 8 warps has
    # ~168 registers (one program per SM), 64 x 256 / 4 warps ~220 (two)
    GemvConfig(bn, bk, w, 1, sk, use_dot=True, diag=True, pdl=True, persist=ps)
    for bn, bk, w, sk, ps in ((128, 256, 8, 1, 1), (128, 256, 8, 2, 1), (64, 256, 4, 2, 2))
) + tuple(
    # 128 registers (130 uncapped; no spills under Triton 3.6): 2 programs of 256 threads per SM
    GemvConfig(128, 256, 8, 0, sk, use_dot=True, diag=True, pdl=True, maxnreg=128)
    for sk in (1, 4)
)


def candidates(m: int, group_size: int, in_features: int) -> list[GemvConfig]:
    """The tuning candidates for a batch of m rows whose K tiles line up with the groups. Batch
    1 is pruned to what came within 15 % of the best on some Llama-3-8B linear in the H100 sweep
    (benchmarks/int4_b1_sweep.py), plus the fallbacks for shapes the wide tiles do not serve:
    no diag tiles (2-3x slower than wide at batch 1), two lop3 ones, no tensor-core join ones."""
    pool = [*_FMA, *_DOT[:_DOT_FOR_M1]] if m == 1 else list(_DOT)
    if m == 1 and in_features % 32 == 0:  # word rows 16-byte aligned
        pool = [*(c for c in _WORDS
                  if groups_per_tile(c.block_k, group_size, in_features) == 1), *pool]
    if in_features % 32 == 0:  # after the others: a bucket's first candidate stays as it was
        pool += [c for c in (_LOP3_B1 if m == 1 else _LOP3)
                 if groups_per_tile(c.block_k, group_size, in_features) == 1]
    if in_features % 32 == 0:  # the multi-group tiles
        pool += [c for c in ((*_WIDE, *_WIDE_PTX) if m == 1 else _DIAG)
                 if int_gemv_wide.supported(c.block_k, group_size, in_features, m, c.diag)]
    fits = [c for c in pool if tile_fits(c.block_k, group_size, in_features)]
    if not fits:  # e.g. group 32 with K not a multiple of 128: the largest tile that lines up
        block_k = pick_block_k(group_size, in_features)
        if block_k is not None:
            fits = [GemvConfig(bn, block_k, 4, 3, 1, use_dot=m > 1) for bn in (16, 32)]
    return fits


def pick_block_k(group_size: int, in_features: int) -> int | None:
    """The largest K tile (<= 128, >= 32: an int4 half-tile is the dot's K, at least 16) inside
    one group (exact: the scale applies to the partial sums), else the largest holding whole
    groups; None where none lines up (the caller then dequantizes instead)."""
    sizes = (128, 64, 32)
    inside = [b for b in sizes if group_size >= in_features or group_size % b == 0]
    if inside:
        return inside[0]
    return next((b for b in sizes if tile_fits(b, group_size, in_features)), None)


def default_config(m: int, group_size: int, in_features: int) -> GemvConfig:
    """An untuned config that fits (tests, or a call before tuning)."""
    block_k = pick_block_k(group_size, in_features)
    if block_k is None:
        raise ValueError(f"int4_gemv: no K tile fits group size {group_size}")
    return GemvConfig(32, block_k, 4, 2, 1, use_dot=m > 1)


def int4_gemv(
    x: torch.Tensor,  # [M, K] bf16/fp16, 1 <= M <= GEMV_MAX_M
    qweight: torch.Tensor,  # [N, K/2] uint8 (int4) or [N, K] uint8 (int8, bits=8)
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor,  # [N, G], same strides as scales
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    bits: int = 4,
    int_zeros: bool = True,
    config: GemvConfig | None = None,
    counters: torch.Tensor | None = None,  # int32, zero, >= cdiv(N, BLOCK_N): for split-K
    rows: int | None = None,  # lop3 configs only: x padded to this many rows (32, 64: GEMM use)
) -> torch.Tensor:
    """y [M, N] = x @ dequant(qweight).T (+ bias), in x's dtype (W4A16, or W8A16 with bits=8).
    int_zeros: every zero point is an integer (False: GGUF Q4_1 / Q4_K's fractional ones).
    config: a tuned candidate; else the default with block_n / block_k / num_warps overriding.
    Split-K configs need `counters` (zeroed, kept between calls; a fresh zeroed one if None)."""
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.dtype != torch.uint8 or qweight.shape[1] * (8 // bits) != k or bits not in (4, 8):
        raise ValueError(f"int4_gemv: qweight {tuple(qweight.shape)} {qweight.dtype} does not "
                         f"hold {k} int{bits} input features")
    max_m = GEMV_MAX_M if rows is None else rows
    if not 1 <= m <= max_m:
        raise ValueError(f"int4_gemv: {m} rows, expected 1 to {max_m}")
    if rows is not None and (config is None or not config.lop3 or rows & (rows - 1)
                             or not 16 <= rows <= 64):
        raise ValueError(f"int4_gemv: rows={rows} needs a lop3 config and 16, 32 or 64 rows")
    if config is None:
        config = default_config(m, group_size, k)
        config = GemvConfig(block_n or config.block_n, block_k or config.block_k,
                            num_warps or config.warps, config.stages, 1, config.use_dot,
                            config.join)
    if config.block_k < 32:  # the loads' alignment hint (int_dequant.load_halves)
        raise ValueError(f"int4_gemv: K tile {config.block_k} below 32")
    if not tile_fits(config.block_k, group_size, k):
        raise ValueError(f"int4_gemv: K tile {config.block_k} does not fit group size "
                         f"{group_size} (K {k})")
    if config.words and (m != 1 or bits != 4 or k % 32 or qweight.stride(0) % 16
                         or qweight.data_ptr() % 16
                         or groups_per_tile(config.block_k, group_size, k) != 1):
        config = replace(config, words=False, join=True)  # the same tile, read byte-wise
    if config.lop3 and (bits != 4 or k % 32 or qweight.stride(0) % 16 or qweight.data_ptr() % 16
                        or groups_per_tile(config.block_k, group_size, k) != 1):
        if rows is not None and rows > GEMV_MAX_M:
            raise ValueError("int4_gemv: lop3 tiles need int4 weights, K % 32 == 0, 16-byte "
                             "aligned rows and tiles inside one group (int_gemm checks first)")
        config = replace(config, lop3=False, join=True, use_dot=True)  # joined tensor-core tile
    if (config.wide or config.diag) and (
            bits != 4 or k % 32 or qweight.stride(0) % 16 or qweight.data_ptr() % 16
            or not int_gemv_wide.supported(config.block_k, group_size, k, m, config.diag)
            or (config.ptx and scales.numel() >= 2**31)):  # ptx: int32 scale offsets
        config = default_config(m, group_size, k)  # (candidates() offers none of these)
    use_dot = config.use_dot or m > 1 or config.lop3
    # One layout for every call (rows K apart, 16-byte aligned), so capture-time launches hit the
    # specialization tuning compiled and loaded (a single row's stride is never read).
    if x.stride(-1) != 1 or (m > 1 and x.stride(0) != k) or x.data_ptr() % 16:
        x = x.contiguous().clone() if x.is_contiguous() else x.contiguous()
    scales, zeros = scales.contiguous(), zeros.contiguous()
    if config.wide or config.diag:
        return int_gemv_wide.wide_gemv(x, qweight, scales, zeros, group_size, bias,
                                       config.block_n, config.block_k, config.warps,
                                       config.stages, config.split_k, config.diag, config.pdl,
                                       counters, config.persist, config.maxnreg, config.ptx)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    tiles_n = triton.cdiv(n, config.block_n)
    split, k_split = k_splits(k, config.block_k, config.split_k)
    part, counters = split_workspace(split, m, n, tiles_n, counters, scales, "int4_gemv",
                                     grow=False)
    _int_gemv_kernel[(tiles_n, split)](
        x, qweight, scales, zeros, bias if bias is not None else scales, y, part, counters,
        m, n, k, k_split,
        k, qweight.stride(0), scales.stride(0), n,  # rows of x (normalized above) and y: K, N apart
        GROUP=kernel_group(group_size, k),
        NG=groups_per_tile(config.block_k, group_size, k),
        ROWS=(rows or 16) if config.lop3 else 16 if use_dot else 1,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=split,
        STAGES=config.stages,
        HAS_BIAS=bias is not None,
        USE_DOT=use_dot,
        BITS=bits,
        INT_ZEROS=int_zeros,
        X_KIND=x_kind(x.dtype),
        OFFSET=offset_ok(bits, x_kind(x.dtype)),
        JOIN=config.join,
        WORDS=config.words,
        LOP3=config.lop3,
        ASM=config.lop3 and x.is_cuda,  # the interpreter (CPU tensors) runs no inline PTX
        EVEN=config.lop3 and n % config.block_n == 0 and k % config.block_k == 0,
        num_warps=config.warps,
        num_stages=config.stages,
    )
    return y
