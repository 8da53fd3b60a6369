"""W4A16 GEMV tiles of several whole groups (issue 40, batch 1..16): more weight bytes per row
and per program in flight than the one-group tiles of shard/kernels/int_gemv.py.

Why: at batch 1 every int_gemv tile (words, join, lop3) reads BLOCK_K = 128 features = 64 bytes
of each row per K step, and the measured batch-1 linears stayed at 20-41 % of copy bandwidth
whatever the instruction count per weight (benchmarks/INT_KERNELS.md: the lop3 tile at ~2.5-3
SASS per weight was no faster than the word tile at ~5). The bf16 GEMV that reaches 93 % reads
1-2 KB of a row per step, in programs small enough that ~16 sit on an SM. Here a K step reads
BLOCK_K = 256..2048 features (128 B - 1 KB contiguous per row, 16-byte vectors) spanning
NG = BLOCK_K / GROUP groups, and the group scales / zeros of a step are one contiguous
NG x 2-byte run per row (a vector load) instead of one 2-byte load per row and group.

Two tiles, both int4 with tiles of whole groups (GROUP a power of two >= 32 dividing BLOCK_K,
K % BLOCK_K == 0: `supported`):
- "wide" (batch 1, CUDA cores): the words as [BLOCK_N, BLOCK_K / 8] int32 (nibble i of word c
  is feature k0 + 8c + i). Each nibble is masked where one of four shifts of its word leaves
  it (bits 16..19: 128 + q, bits 12..15: 2048 + q as fp32 bit patterns, int_dequant.
  offset_weights' trick: no int-to-float conversion) and multiplied with x's matching plane
  (x's tile split by nibble position once per thread, shared by the rows a thread holds); per
  word, in fp32: acc += s * (sum_i x_i q_i - z * sum_i x_i), the [BLOCK_N, BLOCK_K / 8]
  accumulator reduced once after the K loop. (A [BLOCK_N, NG, GROUP / 8] form of the same
  tile compiled to ~8.5 SASS per weight under Triton 3.6, one row per thread; this 2D one to
  4.4-5.2, sm_90.)
- "diag" (1..16 rows, tensor cores): the lop3 unpack of int_gemv (PRMT + LOP3 inline PTX on
  CUDA) gives the [BLOCK_N, BLOCK_K] tile OFF + q in x's dtype; one MMA against a
  "group-diagonal" x' [ROWS, BLOCK_K] whose row r = m * NG + g holds x row m on group g's
  features and zeros elsewhere (one masked load: masked-off elements are never read) gives the
  per-group partial sums [BLOCK_N, ROWS] at once, using the MMA's padding rows that a batch-1
  tile wastes anyway (ROWS = max(16, MP * NG), MP = the batch bucket). Per column:
  acc += s * (part - (OFF + z) * sum_k x'_rk); y[m] = sum over the NG columns of row m.
Split-K over whole tiles with int_gemv's protocol (int_tiles.finish: partials, an acq_rel
counter, the last split reduces and resets it).

Loads: STAGES 0 = one tile at a time in registers (fewest registers: most programs per SM, the
bf16 GEMV's batch-1 recipe); STAGES 1 = register double buffer (the next tile's words and
scales loaded before this tile's unpack: two tiles per program in flight); STAGES > 1 = Triton's
cp.async pipeline.
PDL (programmatic dependent launch, shard/kernels/pdl.py): with STAGES 0 / 1 a program loads its
first weight tile and scales before waiting on the previous kernel (x, which that kernel
writes, only after), so a kernel's ramp overlaps the previous one's tail, as the bf16 GEMV does
at batch 1.

Runs under TRITON_INTERPRET=1 on CPU tensors (the diag unpack then in Triton operations, bit for
bit the PTX's: tests/shard/test_triton_int_gemv_interpreter.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from shard.kernels import pdl
from shard.kernels.int_dequant import offset_zero, x_kind
from shard.kernels.int_tiles import finish, lop3_tile, split_workspace
from shard.kernels.pdl import let_dependents_launch, wait_for_predecessor

__all__ = ["diag_rows", "supported", "wide_gemv"]


@triton.jit
def _fma_loads(q_ptr, s_ptr, z_ptr, rows, row_mask, k0, k_hi, stride_qn, stride_sn,
               GROUP: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """The "wide" tile at k0: words [BLOCK_N, BLOCK_K / 8] int32 (nibble i of word c = feature
    k0 + 8c + i) and s, z [BLOCK_N, NG] fp32; nothing is read where k0 >= k_hi (a prefetch
    past the range; one predicate per tile, constant along the 16-byte vectors)."""
    NG: tl.constexpr = BLOCK_K // GROUP
    w_rows = (q_ptr + rows.to(tl.int64) * stride_qn).to(tl.pointer_type(tl.int32))  # [BLOCK_N]
    offs = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, BLOCK_K // 8), 4),
                             BLOCK_K // 8)
    live_w = (tl.zeros([BLOCK_K // 8], tl.int32) + k0) < k_hi
    if EVEN:
        words = tl.load(w_rows[:, None] + offs[None, :], mask=live_w[None, :], other=0,
                        eviction_policy="evict_first")
    else:
        words = tl.load(w_rows[:, None] + offs[None, :],
                        mask=row_mask[:, None] & live_w[None, :], other=0,
                        eviction_policy="evict_first")
    g = k0 // GROUP + tl.arange(0, NG)  # [NG] groups of the tile (contiguous per row)
    live = (tl.zeros([NG], tl.int32) + k0) < k_hi
    ptrs = rows.to(tl.int64)[:, None] * stride_sn + g[None, :]
    mask = row_mask[:, None] & live[None, :]
    s = tl.load(s_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    return words, s, z


@triton.jit
def _x_planes(x_ptr, k0, C: tl.constexpr):
    """x's tile at k0 split by nibble position: x_i [C] fp32 = x[k0 + 8c + i] for i = 0..7 (one
    contiguous 16-byte-vector load of [C, 8], then in-register splits)."""
    k3 = k0 + 8 * tl.arange(0, C)[:, None] + tl.arange(0, 8)[None, :]
    x3 = tl.load(x_ptr + k3).to(tl.float32)  # [C, 8]
    ev, od = tl.split(tl.reshape(x3, [C, 4, 2]))  # nibbles 0 2 4 6 / 1 3 5 7
    e04, e26 = tl.split(tl.reshape(ev, [C, 2, 2]))
    o15, o37 = tl.split(tl.reshape(od, [C, 2, 2]))
    x0, x4 = tl.split(e04)
    x2, x6 = tl.split(e26)
    x1, x5 = tl.split(o15)
    x3_, x7 = tl.split(o37)
    return (x0[None, :], x1[None, :], x2[None, :], x3_[None, :], x4[None, :], x5[None, :],
            x6[None, :], x7[None, :])


@triton.jit
def _hi(t):
    """OFF + the nibble at bits 16..19 of t in fp32, OFF = 128 (the nibble at 2^7's unit bit)."""
    return ((t & 0x000F0000) | 0x43000000).to(tl.float32, bitcast=True)


@triton.jit
def _lo(t):
    """OFF + the nibble at bits 12..15 of t in fp32, OFF = 2048 (the nibble at 2^11's unit bit;
    the larger offset costs 4 more bits of cancellation, still < 2^-16 of a word's sum)."""
    return ((t & 0x0000F000) | 0x45000000).to(tl.float32, bitcast=True)


@triton.jit
def _fma_tile(words, s, z, acc, x0, x1, x2, x3, x4, x5, x6, x7):
    """acc [BLOCK_N, C] += s * (sum_i x_i q_i - z sum_i x_i), per word (x_i [1, C]; s, z
    [BLOCK_N, NG], repeated over each group's C / NG words). Each nibble is
    masked where one of four shifts of the word leaves it (bits 16..19: OFF 128, or 12..15: OFF
    2048): 4 shifts, 8 LOP3 and 8 FMA per 8 weights (a shift per nibble otherwise); the offsets'
    sum over the word starts the FMA chain, so removing them costs nothing."""
    xoff = 128.0 * ((x0 + x2) + (x4 + x6)) + 2048.0 * ((x1 + x3) + (x5 + x7))  # [1, C]
    p = _hi(words << 16) * x0 - xoff  # nibble 0
    p += _lo(words << 8) * x1
    p += _hi(words << 8) * x2
    p += _lo(words) * x3
    p += _hi(words) * x4
    p += _lo(words >> 8) * x5
    p += _hi(words >> 8) * x6
    p += _lo(words >> 16) * x7
    xw = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
    BN: tl.constexpr = words.shape[0]
    C: tl.constexpr = words.shape[1]
    NG: tl.constexpr = s.shape[1]
    s_w = tl.reshape(tl.broadcast_to(s[:, :, None], [BN, NG, C // NG]), [BN, C])
    c_w = tl.reshape(tl.broadcast_to((z * s)[:, :, None], [BN, NG, C // NG]), [BN, C])
    return acc + p * s_w - c_w * xw


@triton.jit
def _fma_k_loop(x_ptr, q_ptr, s_ptr, z_ptr, rows, row_mask, k_lo, k_hi, stride_qn, stride_sn,
                GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                STAGES: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr):
    """Batch 1, CUDA cores: [BLOCK_N] fp32 = x[k_lo:k_hi] . dequant(W[rows, k_lo:k_hi])."""
    acc = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    if STAGES == 0:
        # one tile at a time (no prefetch: fewer registers, more programs per SM, as the bf16
        # GEMV's batch-1 winner); the first tile's weights before the wait
        words, s, z = _fma_loads(q_ptr, s_ptr, z_ptr, rows, row_mask, k_lo, k_hi, stride_qn,
                                 stride_sn, GROUP, BLOCK_K, EVEN)
        wait_for_predecessor(PDL)
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_planes(x_ptr, k_lo, BLOCK_K // 8)
        acc = _fma_tile(words, s, z, acc, x0, x1, x2, x3, x4, x5, x6, x7)
        for k0 in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=1):
            words, s, z = _fma_loads(q_ptr, s_ptr, z_ptr, rows, row_mask, k0, k_hi, stride_qn,
                                     stride_sn, GROUP, BLOCK_K, EVEN)
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_planes(x_ptr, k0, BLOCK_K // 8)
            acc = _fma_tile(words, s, z, acc, x0, x1, x2, x3, x4, x5, x6, x7)
    elif STAGES == 1:
        # register double buffer; the first tile (weights only) before the wait on the previous
        # kernel, which writes x
        words, s, z = _fma_loads(q_ptr, s_ptr, z_ptr, rows, row_mask, k_lo, k_hi, stride_qn,
                                 stride_sn, GROUP, BLOCK_K, EVEN)
        wait_for_predecessor(PDL)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=1):
            words_n, s_n, z_n = _fma_loads(q_ptr, s_ptr, z_ptr, rows, row_mask, k0 + BLOCK_K,
                                           k_hi, stride_qn, stride_sn, GROUP, BLOCK_K, EVEN)
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_planes(x_ptr, k0, BLOCK_K // 8)
            acc = _fma_tile(words, s, z, acc, x0, x1, x2, x3, x4, x5, x6, x7)
            words, s, z = words_n, s_n, z_n
    else:
        wait_for_predecessor(PDL)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            words, s, z = _fma_loads(q_ptr, s_ptr, z_ptr, rows, row_mask, k0, k_hi, stride_qn,
                                     stride_sn, GROUP, BLOCK_K, EVEN)
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_planes(x_ptr, k0, BLOCK_K // 8)
            acc = _fma_tile(words, s, z, acc, x0, x1, x2, x3, x4, x5, x6, x7)
    return tl.sum(acc, axis=1)


# ------------------------------------------------------------------------------------------------
# The "wide" tile with inline-PTX loads and unpack (GemvConfig.ptx, STAGES 0 / 1, gridded;
# batch 1).
# Why (sm_90 SASS of the measured winners, benchmarks/INT_KERNELS.md "wide tile below its probe"):
# the Triton form above spends ~4.8 SASS per weight under Triton 3.6 and ~2.4 of them on the INT
# pipe (LOP3 / SHF / PRMT: half the FP32 rate on Hopper), of which ~0.7 are layout conversions of
# x's planes and the scales through shared memory (22-28 barriers a K step: every warp of the
# program waits for the others, so the program cannot overlap its own loads and math) and ~1 the
# unfused mask-and-or (2 LOP3 a nibble: ptxas keeps neither constant in a register). Here:
# - x's 8 planes of word column c are ONE 16-byte load (features 8c .. 8c + 7 as 4 int32 pairs),
#   issued by inline PTX on the [1, C] tensor in the words' own layout: Triton's load coalescing
#   cannot move it to another layout, so there is no conversion, no barrier. The planes are then
#   split from the pairs in registers (bf16: a shift / a mask; fp16: a cvt), once per column for
#   all the rows a thread holds.
# - the scales / zeros are loaded per (row, word column) in the same layout (inline PTX, pure:
#   the 4 columns a thread holds in one group share the address and LLVM merges their loads).
# - each nibble is one LOP3 ((t & mask) | exponent, inline PTX: the constants stay in registers)
#   after one of 4 shifts of its word, the right shifts as mul.hi (the FMA pipe's IMAD, not the
#   INT pipe's SHF).
# - per word: p = sum_i x_i (OFF_i + q_i) - xoff; acc += s * (p - z * sum_i x_i) (10 FFMA).
# The interpreter (CPU tensors, ASM False) runs the same arithmetic with Triton loads / bit ops.
def nibble_asm() -> str:
    """PTX: $8 an int32 word, $0..$7 fp32 OFF_i + nibble i (bits 16..19 of a moved copy with
    128's exponent for even i, bits 12..15 with 2048's for odd i; as _hi / _lo). Three moved
    copies, 11 instructions a word: one PRMT puts byte 0 at byte 2 (nibble 0 at bits 16..19)
    and byte 3 at byte 1 (nibble 7 at bits 12..15), a multiply by 2^8 + 2^20 is the word << 8
    at bits 0..19 (nibbles 1, 2; as an IMAD on the FMA pipe, not a shift on the INT pipe), a
    mul.hi by 2^24 the word >> 8 (nibbles 5, 6); nibbles 3, 4 need no move."""
    hi = "0x000F0000, 0x43000000, 0xEA"  # (t & 0xF0000) | 128.0's bits (0xEA: (a & b) | c)
    lo = "0x0000F000, 0x45000000, 0xEA"  # (t & 0xF000) | 2048.0's bits
    return "\n".join([
        "{", ".reg .b32 t;",
        "prmt.b32 t, $8, $8, 0x0030;", f"lop3.b32 $0, t, {hi};", f"lop3.b32 $7, t, {lo};",
        "mul.lo.u32 t, $8, 0x100100;", f"lop3.b32 $1, t, {lo};", f"lop3.b32 $2, t, {hi};",
        f"lop3.b32 $3, $8, {lo};", f"lop3.b32 $4, $8, {hi};",
        "mul.hi.u32 t, $8, 16777216;", f"lop3.b32 $5, t, {lo};", f"lop3.b32 $6, t, {hi};",
        "}"])


_NIBBLE_ASM: tl.constexpr = tl.constexpr(nibble_asm())


@triton.jit
def _nibbles(words, ASM: tl.constexpr):
    """The 8 nibbles of each int32 word as fp32 OFF_i + q_i (nibble_asm; the interpreter's form
    with Triton bit operations, element for element equal)."""
    if ASM:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _NIBBLE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 8,
            is_pure=True, pack=1)
    else:
        v0 = _hi(words << 16)
        v1 = _lo(words << 8)
        v2 = _hi(words << 8)
        v3 = _lo(words)
        v4 = _hi(words)
        v5 = _lo(words >> 8)
        v6 = _hi(words >> 8)
        v7 = _lo(words >> 16)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _pair_planes(p, X_KIND: tl.constexpr):
    """An int32 holding two 16-bit x values (x[2j] low, x[2j + 1] high) as two fp32."""
    if X_KIND == 2:  # bf16: the upper half of an fp32
        return (p << 16).to(tl.float32, bitcast=True), (p & -65536).to(tl.float32, bitcast=True)
    else:
        lo = (p & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = ((p >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi


_X_ASM: tl.constexpr = tl.constexpr("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];")
# The first tile's: the PDL wait in the same asm statement, so that the load (a pure asm, which
# LLVM may move) can never be issued before the previous kernel, which writes x, has finished.
_X_ASM_WAIT: tl.constexpr = tl.constexpr("griddepcontrol.wait;\n"
                                         "ld.global.v4.b32 {$0, $1, $2, $3}, [$4];")


@triton.jit
def _ptx_x(xp, X_KIND: tl.constexpr, ASM: tl.constexpr, WAIT: tl.constexpr):
    """x's planes [1, C] fp32 (x_i[c] = x[k0 + 8c + i]) from one 16-byte load per column, in the
    words' layout (a pure asm: Triton rematerializes it in the consumer's layout; a non-pure one
    stays in a default layout under Triton 3.9 and costs a conversion per plane). WAIT: the PDL
    wait first (the first tile)."""
    if ASM:
        addr = xp.to(tl.int64, bitcast=True)
        if WAIT:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                _X_ASM_WAIT, "=r,=r,=r,=r,l", [addr], dtype=(tl.int32,) * 4, is_pure=True,
                pack=1)
        else:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                _X_ASM, "=r,=r,=r,=r,l", [addr], dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    else:
        wait_for_predecessor(WAIT)
        xp = xp.to(tl.pointer_type(tl.int32))
        p0 = tl.load(xp)
        p1 = tl.load(xp + 1)
        p2 = tl.load(xp + 2)
        p3 = tl.load(xp + 3)
    x0, x1 = _pair_planes(p0, X_KIND)
    x2, x3 = _pair_planes(p1, X_KIND)
    x4, x5 = _pair_planes(p2, X_KIND)
    x6, x7 = _pair_planes(p3, X_KIND)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _ptx_group(ptr, ASM: tl.constexpr):
    """*ptr [BLOCK_N, C] as fp32 (scales or zeros: 16- or 32-bit floats), in ptr's layout."""
    if ASM:
        addr = ptr.to(tl.int64, bitcast=True)
        if ptr.dtype.element_ty.primitive_bitwidth == 16:
            v = tl.inline_asm_elementwise("ld.global.nc.b16 $0, [$1];", "=h,l", [addr],
                                          dtype=tl.int16, is_pure=True, pack=1)
        else:
            v = tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [addr],
                                          dtype=tl.int32, is_pure=True, pack=1)
        return v.to(ptr.dtype.element_ty, bitcast=True).to(tl.float32)
    else:
        return tl.load(ptr).to(tl.float32)


@triton.jit
def _ptx_tile(words, x_ptr, s_ptr, z_ptr, xb, sb, k0, acc, GROUP: tl.constexpr,
              X_KIND: tl.constexpr, ASM: tl.constexpr, WAIT: tl.constexpr, QUAD: tl.constexpr):
    """Per word: p = sum_i x_i (OFF_i + q_i) - xoff; then acc [BLOCK_N, C] += s * (p - z * sum_i
    x_i), or with QUAD acc [BLOCK_N, C / 4] += s * (sum of 4 adjacent words' p - z * their sum
    of x): 4 words = 32 features lie in one group (GROUP >= 32) and in one thread (the words'
    16-byte vectors), so the sum stays in registers and the scaling costs 2 FFMA per 4 words
    instead of per word (Triton 3.6; 3.9 sums x's 4-word runs across lanes: a shuffle and a
    barrier a K step)."""
    C: tl.constexpr = words.shape[1]
    BN: tl.constexpr = words.shape[0]
    x0, x1, x2, x3, x4, x5, x6, x7 = _ptx_x(x_ptr + k0 + xb, X_KIND, ASM, WAIT)
    if QUAD:  # each 4-word run's group
        offs = sb + (k0 // GROUP + tl.arange(0, C // 4) // (GROUP // 32))[None, :]
    else:  # each word's group
        offs = sb + (k0 // GROUP + tl.arange(0, C) // (GROUP // 8))[None, :]
    s = _ptx_group(s_ptr + offs, ASM)
    z = _ptx_group(z_ptr + offs, ASM)
    v0, v1, v2, v3, v4, v5, v6, v7 = _nibbles(words, ASM)
    xe = (x0 + x2) + (x4 + x6)
    xo = (x1 + x3) + (x5 + x7)
    xw = xe + xo  # [1, C]
    xoff = 128.0 * xe + 2048.0 * xo
    p = v0 * x0 - xoff
    p += v1 * x1
    p += v2 * x2
    p += v3 * x3
    p += v4 * x4
    p += v5 * x5
    p += v6 * x6
    p += v7 * x7
    if QUAD:
        pq = tl.sum(tl.reshape(p, [BN, C // 4, 4]), axis=2)
        xq = tl.sum(tl.reshape(xw, [1, C // 4, 4]), axis=2)
        return acc + s * (pq - z * xq)
    else:
        return acc + s * (p - z * xw)


@triton.jit
def _ptx_words(q_ptr, rows, row_mask, k0, k_hi, stride_qn, BLOCK_K: tl.constexpr,
               EVEN: tl.constexpr):
    """The words [BLOCK_N, BLOCK_K / 8] int32 at k0 (16-byte vectors, evict-first); nothing is
    read where k0 >= k_hi (a prefetch past the range: one predicate per tile)."""
    w_rows = (q_ptr + rows.to(tl.int64) * stride_qn).to(tl.pointer_type(tl.int32))
    offs = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, BLOCK_K // 8), 4),
                             BLOCK_K // 8)
    live = (tl.zeros([BLOCK_K // 8], tl.int32) + k0) < k_hi
    if EVEN:
        return tl.load(w_rows[:, None] + offs[None, :], mask=live[None, :], other=0,
                       eviction_policy="evict_first")
    else:
        return tl.load(w_rows[:, None] + offs[None, :], mask=row_mask[:, None] & live[None, :],
                       other=0, eviction_policy="evict_first")


@triton.jit
def _ptx_k_loop(x_ptr, q_ptr, s_ptr, z_ptr, rows, row_mask, k_lo, k_hi, stride_qn, stride_sn,
                GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                STAGES: tl.constexpr, X_KIND: tl.constexpr, ASM: tl.constexpr,
                EVEN: tl.constexpr, PDL: tl.constexpr, QUAD: tl.constexpr):
    """Batch 1: [BLOCK_N] fp32 = x[k_lo:k_hi] . dequant(W[rows, k_lo:k_hi]). STAGES 0: one tile
    at a time; 1: the next tile's words loaded before this tile's math (a register double
    buffer: two tiles a program in flight, ~16-32 more registers). The first tile (peeled) has
    its words loaded before the PDL wait, which sits in its x load (_ptx_x)."""
    # loop-invariant bases (the K step adds a scalar): x's word columns [1, C] (8 features
    # apart) and the scale / zero rows [BLOCK_N, 1] (rows past N read row 0's, never stored)
    C: tl.constexpr = BLOCK_K // 8
    xb = 8 * tl.arange(0, C)[None, :]
    sb = tl.where(row_mask, rows, 0)[:, None] * stride_sn  # int32: N x groups < 2^31
    acc = tl.zeros([BLOCK_N, C // 4 if QUAD else C], dtype=tl.float32)
    words = _ptx_words(q_ptr, rows, row_mask, k_lo, k_hi, stride_qn, BLOCK_K, EVEN)
    if STAGES == 0:
        acc = _ptx_tile(words, x_ptr, s_ptr, z_ptr, xb, sb, k_lo, acc, GROUP, X_KIND, ASM, PDL,
                        QUAD)
        for k0 in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=1):
            words = _ptx_words(q_ptr, rows, row_mask, k0, k_hi, stride_qn, BLOCK_K, EVEN)
            acc = _ptx_tile(words, x_ptr, s_ptr, z_ptr, xb, sb, k0, acc, GROUP, X_KIND, ASM,
                                False, QUAD)
    else:
        words_n = _ptx_words(q_ptr, rows, row_mask, k_lo + BLOCK_K, k_hi, stride_qn, BLOCK_K,
                             EVEN)
        acc = _ptx_tile(words, x_ptr, s_ptr, z_ptr, xb, sb, k_lo, acc, GROUP, X_KIND, ASM, PDL,
                        QUAD)
        words = words_n
        for k0 in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=1):
            words_n = _ptx_words(q_ptr, rows, row_mask, k0 + BLOCK_K, k_hi, stride_qn, BLOCK_K,
                                 EVEN)
            acc = _ptx_tile(words, x_ptr, s_ptr, z_ptr, xb, sb, k0, acc, GROUP, X_KIND, ASM,
                                False, QUAD)
            words = words_n
    return tl.sum(acc, axis=1)


@triton.jit
def _diag_weights(q_ptr, s_ptr, z_ptr, rows, row_mask, M, k0, k_hi, stride_qn, stride_sn,
                  GROUP: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                  EVEN: tl.constexpr):
    """The "diag" tile's weights at k0: words [BLOCK_N, BLOCK_K / 8] int32 and s, z
    [BLOCK_N, ROWS] fp32 (column r = m * NG + g: group g's scale and zero); nothing is read
    where k0 >= k_hi."""
    NG: tl.constexpr = BLOCK_K // GROUP
    w_rows = (q_ptr + rows.to(tl.int64) * stride_qn).to(tl.pointer_type(tl.int32))
    offs_w = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, BLOCK_K // 8), 4),
                               BLOCK_K // 8)  # (as int_gemv._lop3_loads: Triton 3.6 needs it)
    live_w = (tl.zeros([BLOCK_K // 8], tl.int32) + k0) < k_hi
    if EVEN:
        words = tl.load(w_rows[:, None] + offs_w[None, :], mask=live_w[None, :], other=0,
                        eviction_policy="evict_first")
    else:
        words = tl.load(w_rows[:, None] + offs_w[None, :],
                        mask=row_mask[:, None] & live_w[None, :], other=0,
                        eviction_policy="evict_first")
    # one contiguous NG x 2-byte run per row, repeated for the ROWS / NG rows of x' (columns of
    # x rows >= M meet all-zero x' rows: their scale does not matter)
    g = k0 // GROUP + tl.arange(0, NG)
    live = (tl.zeros([NG], tl.int32) + k0) < k_hi
    ptrs = rows.to(tl.int64)[:, None] * stride_sn + g[None, :]
    mask = row_mask[:, None] & live[None, :]
    s = tl.load(s_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_N, NG]
    z = tl.load(z_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    BN: tl.constexpr = s.shape[0]
    s = tl.reshape(tl.broadcast_to(s[:, None, :], [BN, ROWS // NG, NG]), [BN, ROWS])
    z = tl.reshape(tl.broadcast_to(z[:, None, :], [BN, ROWS // NG, NG]), [BN, ROWS])
    return words, s, z


@triton.jit
def _diag_x(x_ptr, M, k0, stride_xm, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
            ROWS: tl.constexpr):
    """x' [ROWS, BLOCK_K] in x's dtype: row r = m * NG + g is x row m on group g's features of
    the tile at k0, 0 elsewhere and for m >= M (those elements are not read); and its row sums
    [ROWS] fp32, from a compact [ROWS / NG, NG, GROUP] load (not the x' tile: ROWS x BLOCK_K
    additions per K step cost ~1 instruction per weight at BLOCK_N 64)."""
    NG: tl.constexpr = BLOCK_K // GROUP
    MR: tl.constexpr = ROWS // NG
    r = tl.arange(0, ROWS)
    kk = tl.arange(0, BLOCK_K)
    m = r // NG
    mask = (m < M)[:, None] & ((kk // GROUP)[None, :] == (r % NG)[:, None])
    xd = tl.load(x_ptr + m[:, None] * stride_xm + k0 + kk[None, :], mask=mask, other=0.0)
    m3 = tl.arange(0, MR)[:, None, None]
    k3 = tl.arange(0, NG)[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    x3 = tl.load(x_ptr + m3 * stride_xm + k0 + k3, mask=m3 < M, other=0.0)  # [MR, NG, GROUP]
    xs = tl.reshape(tl.sum(x3.to(tl.float32), axis=2), [ROWS])
    return xd, xs


@triton.jit
def _diag_tile(words, s, z, xd, xs, acc, X_KIND: tl.constexpr, ASM: tl.constexpr):
    """acc [BLOCK_N, ROWS] += s * ((OFF + q) @ x'^T - (OFF + z) * sum_k x')."""
    v = lop3_tile(words, X_KIND, ASM)  # [BLOCK_N, BLOCK_K] OFF + q in x's dtype
    part = tl.dot(v, tl.trans(xd))  # [BLOCK_N, ROWS] per-group partial sums
    return acc + (part - offset_zero(z, 4, X_KIND) * xs[None, :]) * s


@triton.jit
def _diag_k_loop(x_ptr, q_ptr, s_ptr, z_ptr, rows, row_mask, M, k_lo, k_hi, stride_xm,
                 stride_qn, stride_sn, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr,
                 X_KIND: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr,
                 PDL: tl.constexpr):
    """1..16 rows, tensor cores: [BLOCK_N, ROWS] fp32 per-group columns (see the module doc)."""
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    if STAGES == 0:
        # one tile at a time (no prefetch); the first tile's weights before the wait
        words, s, z = _diag_weights(q_ptr, s_ptr, z_ptr, rows, row_mask, M, k_lo, k_hi,
                                    stride_qn, stride_sn, GROUP, BLOCK_K, ROWS, EVEN)
        wait_for_predecessor(PDL)
        xd, xs = _diag_x(x_ptr, M, k_lo, stride_xm, GROUP, BLOCK_K, ROWS)
        acc = _diag_tile(words, s, z, xd, xs, acc, X_KIND, ASM)
        for k0 in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=1):
            words, s, z = _diag_weights(q_ptr, s_ptr, z_ptr, rows, row_mask, M, k0, k_hi,
                                        stride_qn, stride_sn, GROUP, BLOCK_K, ROWS, EVEN)
            xd, xs = _diag_x(x_ptr, M, k0, stride_xm, GROUP, BLOCK_K, ROWS)
            acc = _diag_tile(words, s, z, xd, xs, acc, X_KIND, ASM)
    elif STAGES == 1:
        # the weights double-buffered in registers; x' (L1-resident after the first programs)
        # loaded in the step that uses it, which keeps the registers for the weights
        words, s, z = _diag_weights(q_ptr, s_ptr, z_ptr, rows, row_mask, M, k_lo, k_hi,
                                    stride_qn, stride_sn, GROUP, BLOCK_K, ROWS, EVEN)
        wait_for_predecessor(PDL)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=1):
            words_n, s_n, z_n = _diag_weights(q_ptr, s_ptr, z_ptr, rows, row_mask, M,
                                              k0 + BLOCK_K, k_hi, stride_qn, stride_sn, GROUP,
                                              BLOCK_K, ROWS, EVEN)
            xd, xs = _diag_x(x_ptr, M, k0, stride_xm, GROUP, BLOCK_K, ROWS)
            acc = _diag_tile(words, s, z, xd, xs, acc, X_KIND, ASM)
            words, s, z = words_n, s_n, z_n
    else:
        wait_for_predecessor(PDL)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            words, s, z = _diag_weights(q_ptr, s_ptr, z_ptr, rows, row_mask, M, k0, k_hi,
                                        stride_qn, stride_sn, GROUP, BLOCK_K, ROWS, EVEN)
            xd, xs = _diag_x(x_ptr, M, k0, stride_xm, GROUP, BLOCK_K, ROWS)
            acc = _diag_tile(words, s, z, xd, xs, acc, X_KIND, ASM)
    return acc


@triton.jit
def _unit_tile(j, pid, P, N, K_SPLIT, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               SPLIT_K: tl.constexpr, TILES: tl.constexpr):
    """A persistent program's j-th tile: its unit u = pid + (j // TILES) * P (units are (row
    block, K split) pairs, row block major), the unit's rows, row mask, row block, split, the
    tile's index in the unit and its first feature."""
    u = pid + (j // TILES) * P
    rb = u // SPLIT_K
    ks = u % SPLIT_K
    t = j % TILES
    rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, rows < N, rb, ks, t, ks * K_SPLIT + t * BLOCK_K


@triton.jit
def _persistent(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K_SPLIT,
                stride_xm, stride_qn, stride_sn, stride_ym, GROUP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                SPLIT_K: tl.constexpr, TILES: tl.constexpr, HAS_BIAS: tl.constexpr,
                X_KIND: tl.constexpr, DIAG: tl.constexpr, ASM: tl.constexpr,
                EVEN: tl.constexpr, PDL: tl.constexpr):
    """Persistent form: P programs (a few per SM) take the units pid, pid + P, ... and stream
    their tiles back to back, the next tile's weights (possibly the next unit's) loaded before
    this one's unpack, so a program's stream never drains between units and the kernel has one
    ramp per program, not one per unit; each unit ends with int_tiles.finish (split-K as in the
    gridded form)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    total = (tl.cdiv(N, BLOCK_N) * SPLIT_K - pid + P - 1) // P * TILES  # this program's tiles
    NG: tl.constexpr = BLOCK_K // GROUP
    MR: tl.constexpr = ROWS // NG
    rows, row_mask, rb, ks, t, k0 = _unit_tile(0, pid, P, N, K_SPLIT, BLOCK_N, BLOCK_K,
                                               SPLIT_K, TILES)
    if DIAG:
        words, s, z = _diag_weights(q_ptr, s_ptr, z_ptr, rows, row_mask, M, k0, k0 + 1,
                                    stride_qn, stride_sn, GROUP, BLOCK_K, ROWS, EVEN)
        acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    else:
        words, s, z = _fma_loads(q_ptr, s_ptr, z_ptr, rows, row_mask, k0, k0 + 1, stride_qn,
                                 stride_sn, GROUP, BLOCK_K, EVEN)
        acc = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    wait_for_predecessor(PDL)
    for j in tl.range(0, total, num_stages=1):
        rows, row_mask, rb, ks, t, k0 = _unit_tile(j, pid, P, N, K_SPLIT, BLOCK_N, BLOCK_K,
                                                   SPLIT_K, TILES)
        rows_n, mask_n, _, _, _, k0_n = _unit_tile(j + 1, pid, P, N, K_SPLIT, BLOCK_N,
                                                           BLOCK_K, SPLIT_K, TILES)
        live_hi = k0_n + (j + 1 < total).to(tl.int32)  # k0_n < live_hi: there is a next tile
        if DIAG:
            words_n, s_n, z_n = _diag_weights(q_ptr, s_ptr, z_ptr, rows_n, mask_n, M, k0_n,
                                              live_hi, stride_qn, stride_sn, GROUP, BLOCK_K,
                                              ROWS, EVEN)
            xd, xs = _diag_x(x_ptr, M, k0, stride_xm, GROUP, BLOCK_K, ROWS)
            acc = _diag_tile(words, s, z, xd, xs, acc, X_KIND, ASM)
        else:
            words_n, s_n, z_n = _fma_loads(q_ptr, s_ptr, z_ptr, rows_n, mask_n, k0_n, live_hi,
                                           stride_qn, stride_sn, GROUP, BLOCK_K, EVEN)
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_planes(x_ptr, k0, BLOCK_K // 8)
            acc = _fma_tile(words, s, z, acc, x0, x1, x2, x3, x4, x5, x6, x7)
        if t == TILES - 1:  # the unit's last tile: its output (or split-K partial)
            if DIAG:
                out = tl.trans(tl.sum(tl.reshape(acc, [BLOCK_N, MR, NG]), axis=2))
                offs_m = tl.arange(0, MR)
                finish(out, offs_m, offs_m < M, rows, row_mask, rb, ks, b_ptr, y_ptr, part_ptr,
                       count_ptr, M, N, stride_ym, MR, BLOCK_N, SPLIT_K, HAS_BIAS)
                acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
            else:
                out = tl.sum(acc, axis=1)[None, :]
                offs_m = tl.arange(0, 1)
                finish(out, offs_m, offs_m < M, rows, row_mask, rb, ks, b_ptr, y_ptr, part_ptr,
                       count_ptr, M, N, stride_ym, 1, BLOCK_N, SPLIT_K, HAS_BIAS)
                acc = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
        words, s, z = words_n, s_n, z_n


@triton.jit(do_not_specialize=["M"])
def _wide_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr,
    part_ptr,  # SPLIT_K > 1: [SPLIT_K, M, N] fp32 workspace
    count_ptr,  # SPLIT_K > 1: [>= cdiv(N, BLOCK_N)] int32, zero between launches
    M, N, K,
    K_SPLIT,  # input features per split: a multiple of BLOCK_K
    stride_xm, stride_qn, stride_sn, stride_ym,
    GROUP: tl.constexpr,  # a power of two >= 32 dividing BLOCK_K
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,  # DIAG: the MMA's x' rows, max(16, bucket * NG); else 1
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    X_KIND: tl.constexpr,  # int_dequant.x_kind: fp16 1, bf16 2
    DIAG: tl.constexpr,  # the tensor-core tile (else "wide": batch 1, CUDA cores)
    ASM: tl.constexpr,  # DIAG's unpack as inline PTX (False: the interpreter's form)
    EVEN: tl.constexpr,  # N % BLOCK_N == 0: no row masks on the weight loads
    PDL: tl.constexpr,
    PERSIST: tl.constexpr = False,  # a few programs per SM loop over the units (_persistent)
    TILES: tl.constexpr = 1,  # PERSIST: K tiles per split (K_SPLIT / BLOCK_K)
    XPTX: tl.constexpr = 0,  # the wide tile's inline-PTX form (_ptx_k_loop; STAGES 0 / 1);
    # 2: its scaling per 4 words (_ptx_tile's QUAD)
):
    let_dependents_launch(PDL)
    if PERSIST:
        _persistent(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K_SPLIT,
                    stride_xm, stride_qn, stride_sn, stride_ym, GROUP, BLOCK_N, BLOCK_K, ROWS,
                    SPLIT_K, TILES, HAS_BIAS, X_KIND, DIAG, ASM, EVEN, PDL)
    else:
        _gridded(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT,
                 stride_xm, stride_qn, stride_sn, stride_ym, GROUP, BLOCK_N, BLOCK_K, ROWS,
                 SPLIT_K, STAGES, HAS_BIAS, X_KIND, DIAG, ASM, EVEN, PDL, XPTX)


@triton.jit
def _gridded(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT,
             stride_xm, stride_qn, stride_sn, stride_ym, GROUP: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
             SPLIT_K: tl.constexpr, STAGES: tl.constexpr, HAS_BIAS: tl.constexpr,
             X_KIND: tl.constexpr, DIAG: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr,
             PDL: tl.constexpr, XPTX: tl.constexpr):
    """One program per (row block, K split): program (pid_n, pid_k)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] weight rows / outputs
    row_mask = rows < N
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    if DIAG:
        NG: tl.constexpr = BLOCK_K // GROUP
        MR: tl.constexpr = ROWS // NG  # x rows the columns stand for (>= the bucket)
        acc = _diag_k_loop(x_ptr, q_ptr, s_ptr, z_ptr, rows, row_mask, M, k_lo, k_hi,
                           stride_xm, stride_qn, stride_sn, GROUP, BLOCK_N, BLOCK_K, ROWS,
                           STAGES, X_KIND, ASM, EVEN, PDL)
        out = tl.trans(tl.sum(tl.reshape(acc, [BLOCK_N, MR, NG]), axis=2))  # [MR, BLOCK_N]
        offs_m = tl.arange(0, MR)
    else:
        if XPTX:
            acc = _ptx_k_loop(x_ptr, q_ptr, s_ptr, z_ptr, rows, row_mask, k_lo, k_hi, stride_qn,
                              stride_sn, GROUP, BLOCK_N, BLOCK_K, STAGES, X_KIND, ASM, EVEN,
                              PDL, XPTX == 2)
        else:
            acc = _fma_k_loop(x_ptr, q_ptr, s_ptr, z_ptr, rows, row_mask, k_lo, k_hi, stride_qn,
                              stride_sn, GROUP, BLOCK_N, BLOCK_K, STAGES, EVEN, PDL)
        out = acc[None, :]  # [1, BLOCK_N]
        offs_m = tl.arange(0, 1)
    finish(out, offs_m, offs_m < M, rows, row_mask, pid_n, pid_k, b_ptr, y_ptr, part_ptr,
           count_ptr, M, N, stride_ym, out.shape[0], BLOCK_N, SPLIT_K, HAS_BIAS)


def diag_rows(m: int, block_k: int, group: int) -> int:
    """The diag tile's MMA rows for a batch of m rows (its bucket's power of two times the
    groups per tile, at least 16)."""
    bucket = 1 << max(m - 1, 0).bit_length()
    return max(16, bucket * (block_k // group))


# The diag tile's x' is ROWS x BLOCK_K of x's dtype per program and K step (mostly zeros, never
# read): above 32 rows it outweighs the weight tile of any candidate.
MAX_DIAG_ROWS = 32


def supported(block_k: int, group: int, k: int, m: int, diag: bool) -> bool:
    """Whether the wide (diag False: batch 1 only) or diag tile serves this shape: int4 tiles of
    whole groups of a power of two >= 32 (16-byte word runs), no K tail, and for diag at most
    MAX_DIAG_ROWS MMA rows at this batch."""
    if group >= k or group < 32 or group & (group - 1) or block_k % group or k % block_k:
        return False
    if diag:
        return diag_rows(m, block_k, group) <= MAX_DIAG_ROWS
    return m == 1


def wide_gemv(
    x: torch.Tensor,  # [M, K] bf16/fp16, rows K apart, 16-byte aligned
    qweight: torch.Tensor,  # [N, K/2] uint8, 16-byte aligned rows
    scales: torch.Tensor,  # [N, G] contiguous
    zeros: torch.Tensor,  # [N, G] contiguous
    group_size: int,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    warps: int,
    stages: int,
    split_k: int,
    diag: bool,
    use_pdl: bool,
    counters: torch.Tensor | None,
    persist: int = 0,
    maxnreg: int = 0,
    ptx: int = 0,
) -> torch.Tensor:
    """y [M, N] = x @ dequant(qweight).T (+ bias) with a wide / diag tile (int_gemv.int4_gemv
    checks `supported` and normalizes x first). persist > 0: the persistent form with
    min(units, persist x SMs) programs; maxnreg > 0: registers per thread capped (CUDA); ptx:
    the wide tile's inline-PTX form (_ptx_k_loop: stages 0 / 1, gridded, batch 1 only; 2: its
    scaling per 4 words)."""
    if ptx and (diag or persist or stages > 1):
        raise ValueError("int4_gemv: the ptx wide tile is gridded, stages 0 / 1, batch 1 only")
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    tiles_n = triton.cdiv(n, block_n)
    tiles_k = k // block_k
    split = max(1, min(split_k, tiles_k))
    if persist:  # every unit the same number of tiles: the largest split dividing them
        split = max(d for d in range(1, split + 1) if tiles_k % d == 0)
    k_split = triton.cdiv(tiles_k, split) * block_k
    split = triton.cdiv(k, k_split)
    part, counters = split_workspace(split, m, n, tiles_n, counters, scales, "int4_gemv",
                                     grow=False)
    launch = pdl.launch_options(x.device) if use_pdl else {"PDL": False}
    if maxnreg and x.is_cuda:
        launch["maxnreg"] = maxnreg
    grid = (min(tiles_n * split, persist * _sm_count(x.device)), 1) if persist else (tiles_n,
                                                                                     split)
    _wide_gemv_kernel[grid](
        x, qweight, scales, zeros, bias if bias is not None else scales, y, part, counters,
        m, n, k, k_split, k, qweight.stride(0), scales.stride(0), n,
        GROUP=group_size,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ROWS=diag_rows(m, block_k, group_size) if diag else 1,
        SPLIT_K=split,
        STAGES=stages,
        HAS_BIAS=bias is not None,
        X_KIND=x_kind(x.dtype),
        DIAG=diag,
        ASM=(diag or ptx) and x.is_cuda,  # the interpreter (CPU tensors) runs no inline PTX
        EVEN=n % block_n == 0,
        PERSIST=bool(persist),
        TILES=k_split // block_k,
        XPTX=int(ptx),
        num_warps=warps,
        num_stages=max(1, stages),
        **launch,
    )
    return y


@functools.cache
def _sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; 2 under the interpreter (CPU tensors: a persistent grid smaller
    than the units, so the tests see programs looping over several)."""
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count
