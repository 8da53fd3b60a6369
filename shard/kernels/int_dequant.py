"""Shared Triton pieces of the W4A16 / W8A16 kernels (shard/kernels/int_gemv.py, int_gemm.py):
loading a packed weight tile and applying its group scales and zero points in registers.

Layout (shard/quantization/int_weights.py, PackedInt): qweight [N, K/2] uint8 for int4, storage
column 2j in the low nibble of byte j and 2j+1 in the high one; [N, K] uint8 for int8; scales and
zeros [N, G]; w[n, k] = (q[n, k] - zeros[n, k // GROUP]) * scales[n, k // GROUP].

Two tile forms. Halves (the first version's): an int4 tile of BLOCK_K input features kept as the
low nibbles (features k0 + 2j) and the high ones (k0 + 2j + 1), each [BLOCK_N, BLOCK_K / 2], with
x's even and odd columns loaded to match; those stride-2 loads of x are too narrow for cp.async,
so they stall every K step (tests/shard/test_int_kernels_sm90_ptx.py). Joined (`load_joined`):
the nibbles re-interleaved in registers (tl.interleave) into the [BLOCK_N, BLOCK_K] tile in
feature order, x's tile one contiguous, pipelined load; `scale_tile` then dequantizes it with one
FMA per weight. Scales and zeros are 2-byte loads per row, not pipelined either: the kernels load
them one K step ahead.

Groups: a tile either lies inside one group (GROUP % BLOCK_K == 0, or one group per row: the
scale and zero are a [BLOCK_N] vector per tile) or holds BLOCK_K / GROUP whole groups (BLOCK_K %
GROUP == 0: the half-tile is viewed as [BLOCK_N, groups, columns per group] and scaled per group).
`tile_fits` says which (BLOCK_K, GROUP, K) the kernels accept.
"""

from __future__ import annotations

import triton
import triton.language as tl


def tile_fits(block_k: int, group: int, k: int) -> bool:
    """Whether a K tile of block_k features lines up with groups of `group` (group >= k: one
    group per row)."""
    if group >= k or group % block_k == 0:
        return True
    # several whole groups per tile: Triton's shapes are powers of two, and no tile may run past
    # K (its groups' scales would be read past the row)
    return block_k % group == 0 and group >= 2 and group & (group - 1) == 0 and k % block_k == 0


@triton.jit
def load_halves(q_ptr, rows, row_mask, k0, K, stride_qn, BLOCK_K: tl.constexpr, BITS: tl.constexpr):
    """The weight tile at input features [k0, k0 + BLOCK_K) of `rows`, as unsigned integers
    (uint8): int4 -> (low nibbles [BLOCK_N, BLOCK_K/2] = features k0 + 2j, high = k0 + 2j + 1);
    int8 -> (the [BLOCK_N, BLOCK_K] tile, the same tile again: callers use the first only).
    Read once, so marked evict-first."""
    q_rows = q_ptr + rows.to(tl.int64) * stride_qn  # [BLOCK_N] row starts (N * K can pass 2^31)
    if BITS == 4:
        # byte columns; k0 is a multiple of BLOCK_K >= 32, so the start is 16-byte aligned (given
        # 16-byte aligned rows): said outright, so that the loads are 16-byte vectors
        offs_b = tl.max_contiguous(tl.multiple_of(k0 // 2 + tl.arange(0, BLOCK_K // 2), 16),
                                   BLOCK_K // 2)
        packed = tl.load(q_rows[:, None] + offs_b[None, :],
                         mask=row_mask[:, None] & (offs_b < K // 2)[None, :], other=0,
                         eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K / 2] uint8
        return packed & 0xF, packed >> 4
    else:
        offs_q = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), 16), BLOCK_K)
        q = tl.load(q_rows[:, None] + offs_q[None, :],
                    mask=row_mask[:, None] & (offs_q < K)[None, :], other=0,
                    eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K]
        return q, q


@triton.jit
def load_joined(q_ptr, rows, row_mask, k0, K, stride_qn, BLOCK_K: tl.constexpr,
                BITS: tl.constexpr):
    """The weight tile at input features [k0, k0 + BLOCK_K) of `rows` in feature order,
    [BLOCK_N, BLOCK_K] uint8: int4 nibbles re-interleaved in registers (tl.join + reshape: byte j's
    low nibble is feature k0 + 2j, its high one k0 + 2j + 1; a register-level shuffle), so that x's tile is one contiguous
    load (16-byte vectors, pipelined by cp.async) instead of two stride-2 ones."""
    lo, hi = load_halves(q_ptr, rows, row_mask, k0, K, stride_qn, BLOCK_K, BITS)
    if BITS == 4:
        return tl.interleave(lo, hi)  # [BLOCK_N, BLOCK_K]: tl.join + reshape
    else:
        return lo


@triton.jit
def scale_tile(q, s, z, NG: tl.constexpr, BITS: tl.constexpr):
    """(q - z) * s in fp32 for a tile q [BLOCK_N, C] of unsigned integers (C columns holding NG
    equal runs of one group each; s, z [BLOCK_N, NG] fp32), without an int-to-float conversion:
    OFF + q by bit operations (offset_weights, fp32), then one FMA with c = -(OFF + z) * s.
    Exact for integer zero points and fp16 scales (both products fit fp32's 24 bits), so rounding
    the result to x's dtype gives PackedInt.dequantize(x.dtype) bit for bit."""
    v = offset_weights(q, BITS, 0)  # [BLOCK_N, C] OFF + q in fp32
    c = -offset_zero(z, BITS, 0) * s  # [BLOCK_N, NG]
    if NG == 1:
        return v * s + c
    else:
        v3 = tl.reshape(v, [v.shape[0], NG, v.shape[1] // NG])
        w3 = v3 * s[:, :, None] + c[:, :, None]
        return tl.reshape(w3, [v.shape[0], v.shape[1]])


@triton.jit
def load_words(q_ptr, rows, row_mask, k0, K, stride_qn, BLOCK_K: tl.constexpr):
    """int4 only: the tile's packed bytes as int32 words, [BLOCK_N, BLOCK_K / 8]; nibble i of
    word c is feature k0 + 8c + i (bytes little-endian, low nibble first). Needs K % 32 == 0
    and 16-byte aligned rows (callers check)."""
    w_ptr = q_ptr.to(tl.pointer_type(tl.int32))
    offs_w = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, BLOCK_K // 8), 4),
                               BLOCK_K // 8)
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * (stride_qn // 4) + offs_w[None, :],
                   mask=row_mask[:, None] & (offs_w < K // 8)[None, :], other=0,
                   eviction_policy="evict_first")


@triton.jit
def _nibble_weights(words, s, c, I: tl.constexpr, DTYPE: tl.constexpr):
    """(q - z) * s of nibble I of every word, rounded to DTYPE: [BLOCK_N, BLOCK_K / 8]."""
    v = (((words >> (4 * I)) & 0xF) << 16 | (134 << 23)).to(tl.float32, bitcast=True)
    return (v * s + c).to(DTYPE)


@triton.jit
def words_tile(words, s, z, DTYPE: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile in feature order and DTYPE from load_words' words and
    one group's s, z [BLOCK_N, 1] (fp32): per weight one shift and one LOP3 (128 + q in fp32
    bits), one FMA and half a pack instruction, then three interleaves (register moves) back
    into feature order."""
    c = -(z + 128.0) * s
    e0 = tl.interleave(_nibble_weights(words, s, c, 0, DTYPE),
                       _nibble_weights(words, s, c, 4, DTYPE))  # nibbles 0 4
    e1 = tl.interleave(_nibble_weights(words, s, c, 2, DTYPE),
                       _nibble_weights(words, s, c, 6, DTYPE))  # 2 6
    o0 = tl.interleave(_nibble_weights(words, s, c, 1, DTYPE),
                       _nibble_weights(words, s, c, 5, DTYPE))  # 1 5
    o1 = tl.interleave(_nibble_weights(words, s, c, 3, DTYPE),
                       _nibble_weights(words, s, c, 7, DTYPE))  # 3 7
    return tl.interleave(tl.interleave(e0, e1), tl.interleave(o0, o1))  # 0 1 2 .. 7 per word


@triton.jit
def group_params(s_ptr, z_ptr, rows, row_mask, k0, k_end, stride_sn, GROUP: tl.constexpr,
                 NG: tl.constexpr):
    """Scales and zeros of the tile at feature k0 in fp32: [BLOCK_N, NG] (NG groups in the tile;
    NG == 1 also for a tile inside one group); nothing is read where k0 >= k_end (the prefetch
    past a loop's last tile).

    These are 2-byte loads, one per row: too narrow for cp.async, so Triton's pipeliner leaves
    them where they stand and every K step would wait a full L2 round trip on them (with x's
    stride-2 loads, what kept the first GEMV at ~24 % of bandwidth). The loops therefore load the
    next tile's scales one step ahead into registers (loop-carried)."""
    g = k0 // GROUP + tl.arange(0, NG)  # [NG]
    ptrs = rows[:, None] * stride_sn + g[None, :]
    mask = row_mask[:, None] & ((g * 0 + k0) < k_end)[None, :]
    s = tl.load(s_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    return s, z


@triton.jit
def dequant(q, s, z, NG: tl.constexpr):
    """(q - z) * s in fp32 for a half-tile q [BLOCK_N, C] (integers) whose C columns hold NG
    equal runs of one group each; s, z [BLOCK_N, NG]."""
    q = q.to(tl.float32)
    if NG == 1:
        return (q - z) * s
    else:
        q3 = tl.reshape(q, [q.shape[0], NG, q.shape[1] // NG])
        w3 = (q3 - z[:, :, None]) * s[:, :, None]
        return tl.reshape(w3, [q.shape[0], q.shape[1]])


def x_kind(dtype: object) -> int:
    """offset_weights' KIND of a 16-bit activation dtype (a torch dtype): fp16 1, bf16 2."""
    import torch

    return 1 if dtype == torch.float16 else 2


def offset_ok(bits: int, kind: int) -> bool:
    """Whether offset_weights holds `bits`-bit integers exactly in the activation dtype `kind`
    (bf16's 8-bit significand holds 128 + q only for q < 128: int4)."""
    return bits == 4 or kind == 1


@triton.jit
def offset_weights(q, BITS: tl.constexpr, KIND: tl.constexpr):
    """OFF + q exactly in fp32 (KIND 0), fp16 (1) or bf16 (2: x_kind) for unsigned integers q < 2^BITS, without an
    integer-to-float conversion (a quarter-rate instruction on Hopper: 2 per int4 byte capped the
    GEMV near 60 % of HBM bandwidth): q is OR-ed into the mantissa of OFF, a power of two whose
    ulp is 1. OFF: fp32 2^(BITS + 3) (q shifted to the unit bit), fp16 1024, bf16 128 (int4
    only: offset_ok). Callers subtract (OFF + zero) times the sum of x from the product (the
    cancellation costs ~4-7 of fp32's 24 bits)."""
    if KIND == 0:
        return ((q.to(tl.int32) << (20 - BITS)) | ((130 + BITS) << 23)).to(tl.float32,
                                                                            bitcast=True)
    elif KIND == 1:
        return (q.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
    else:
        return (q.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)


@triton.jit
def offset_zero(z, BITS: tl.constexpr, KIND: tl.constexpr):
    """OFF + z in fp32 (z fp32), OFF as offset_weights adds it for KIND."""
    if KIND == 0:
        if BITS == 4:
            return z + 128.0
        else:
            return z + 2048.0
    elif KIND == 1:
        return z + 1024.0
    else:
        return z + 128.0


def groups_per_tile(block_k: int, group: int, k: int) -> int:
    """NG for the kernels: BLOCK_K / GROUP where a tile holds several groups, else 1."""
    if group >= k or group % block_k == 0:
        return 1
    return block_k // group


def kernel_group(group: int, k: int) -> int:
    """The GROUP constexpr: the group size, or K for one group per row."""
    return min(k, group)


__all__ = ["dequant", "group_params", "groups_per_tile", "kernel_group", "load_halves",
           "load_joined", "load_words", "offset_ok", "offset_weights", "offset_zero", "scale_tile", "tile_fits",
           "triton", "words_tile", "x_kind"]
