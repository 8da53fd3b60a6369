"""Triton paged decode attention (one new token per sequence) and the slot-mapped K/V store.

Decode reads every cached K/V byte once per step, so it is memory-bound: the kernel's job is to
stream K/V at full bandwidth. Design:
- grid (num_seqs, num_kv_heads, num_splits): each program owns one KV head of one sequence and
  all query heads that share it (GQA group), so each K/V tile is loaded once for the group;
- split-KV: a sequence's context is cut into `num_splits` equal chunks so that small batches
  still fill the GPU; `num_splits` depends only on the batch size (never on sequence lengths),
  so a CUDA graph captured at one batch size stays valid for any lengths;
- K/V are gathered through the block table one BLOCK_N tile at a time (BLOCK_N spans several
  cache blocks; each row is a contiguous head_dim vector);
- each split stores its partial result (normalised output + log2-sum-exp), then takes a ticket
  (an acq_rel atomic on a per-(sequence, KV head) counter); the split that takes the last one
  merges them all and resets the counter (_merge_splits). No second kernel: at batch 1 that is
  one launch and one programmatic-dependent hop fewer per layer (benchmarks/QUANT_TP.md, ninth
  session). With one split the kernel writes the final output directly.

Fused rotary mode (`rotary_store_decode_attention`, FUSED_ROTARY): the split kernel also does
what shard.kernels.elementwise.rotary_store_kv does before it, saving one launch per layer and step:
- it takes the UNROTATED q/k/v (strided views of the merged projection output), the rotary
  cos/sin tables, positions and slot_mapping;
- every program rotates its GQA group's query heads (GROUP x head_dim, cheap) with the same
  helpers and rounding points as rotary_store_kv, rounds them to the model dtype and joins the
  two halves in registers (power-of-two head_dim; otherwise the halves' padding sits inside the
  row, and q is parked in the program's own output rows and read back after a CTA barrier);
- the one program per (sequence, KV head) whose split holds position seq_len - 1 rotates that
  head's k and stores k, v into the new token's cache slot (fp8: x / scale, saturated; slot < 0:
  a CUDA-graph padding row, nothing stored); at batch 1, where that row is in the program's
  first tile (loaded before the PDL wait), it goes into the tile from registers;
- then a CTA barrier makes those global writes visible to all of the program's threads, and the
  tile loop reads the new token from the cache like any other position.
So the cache is bit-identical to rotary_store_kv followed by paged_decode_attention, and so are
the values the attention computes with; the output matches to bf16 rounding (the two kernels'
dots compile apart: with bf16 caches a few outputs a step come out one bf16 step off,
tests/gpu/test_fused_kernels.py; bit-identical under the interpreter). Other sequences of the
step must not read the new tokens' slots (true: only full blocks are shared, by the prefix
cache), since no ordering exists between programs of different sequences.

Imported only on CUDA machines (triton is not needed on CPU).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shard.kernels import pdl

# The rotary and cache-store building blocks of rotary_store_kv, shared so that the fused mode
# runs the very same instructions (bit-identical results).
from shard.kernels.elementwise import _rope_load, _rope_tables, _to_cache
from shard.kernels.head_norms import HeadNorms
from shard.kernels.l2_warm import launch_args as warm_launch_args
from shard.kernels.l2_warm import warm_share
from shard.kernels.pdl import let_dependents_launch, wait_for_predecessor
from shard.kernels.setting import Setting
from shard.kernels.softcap import soft_cap_log2
from shard.kernels.stamps import program_index, stamp
from shard.kernels.stamps import take as take_stamps
from shard.kernels.tickets import TicketCounters

LOG2E = 1.4426950408889634


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads * head_dim]
    value_ptr,
    key_cache_ptr,  # [num_slots, num_kv_heads * head_dim]
    value_cache_ptr,
    slot_ptr,  # [num_tokens] int64; negative = padding, skipped
    k_scale_ptr,  # [num_kv_heads] fp32 (fp8 caches only)
    v_scale_ptr,
    stride_k_tok,
    stride_v_tok,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,  # > 0: the cache is fp8, store x / scale saturated to +-FP8_MAX
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(key_ptr + tok.to(tl.int64) * stride_k_tok + offs, mask=mask)
    v = tl.load(value_ptr + tok.to(tl.int64) * stride_v_tok + offs, mask=mask)
    if FP8_MAX > 0:
        head = offs // HEAD_DIM
        ks = tl.load(k_scale_ptr + head, mask=mask, other=1.0)
        vs = tl.load(v_scale_ptr + head, mask=mask, other=1.0)
        k = tl.clamp(k.to(tl.float32) / ks, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / vs, -FP8_MAX, FP8_MAX)
    tl.store(key_cache_ptr + slot * ROW + offs, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + slot * ROW + offs, v.to(value_cache_ptr.dtype.element_ty),
             mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 for padding tokens
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32; fp8 caches (None: 1.0)
    v_scale: torch.Tensor | None = None,
) -> None:
    """Writes each token's K/V row into its cache slot (slots < 0 are skipped: graph padding);
    fp8 caches store x / scale per KV head."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    row = key.shape[1] * key.shape[2]
    key2 = key.reshape(num_tokens, row)
    value2 = value.reshape(num_tokens, row)
    assert key2.stride(1) == 1 and value2.stride(1) == 1
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    block = min(triton.next_power_of_2(row), 1024)
    grid = (num_tokens, triton.cdiv(row, block))
    fp8 = key_cache.element_size() == 1
    if fp8 and (k_scale is None or v_scale is None):
        ones = torch.ones(key.shape[1], dtype=torch.float32, device=key.device)
        k_scale = ones if k_scale is None else k_scale
        v_scale = ones if v_scale is None else v_scale
    _store_kv_kernel[grid](
        key2,
        value2,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale if fp8 else slot_mapping,  # unused pointers for model-dtype caches
        v_scale if fp8 else slot_mapping,
        key2.stride(0),
        value2.stride(0),
        ROW=row,
        HEAD_DIM=key.shape[2],
        BLOCK=block,
        FP8_MAX=torch.finfo(key_cache.dtype).max if fp8 else 0.0,
        num_warps=4,
    )


@triton.jit
def _rope_load_normed(src, tok, st_t, st_h, c, s, w_ptr, eps, NH: tl.constexpr,
                      HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                      NORM: tl.constexpr, OFFSET: tl.constexpr):
    """_rope_load, with NORM each head first RMS-normalized over its 2 * HALF values and
    multiplied by w [2 * HALF] with shard/kernels/qk_norm.py's rounding points (normalized,
    rounded to the model dtype, times w, rounded again; OFFSET != 0: x * rstd * (w + OFFSET),
    rounded once), so that the rotation sees the values the separate norm launch would store.
    (The sum of squares adds the two halves' sums: fp32 reassociation only.)"""
    if NORM:
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, HALF_PAD)
        m = (offs_h < NH)[:, None] & (offs_d < HALF)[None, :]
        base = src + tok * st_t + offs_h[:, None] * st_h + offs_d[None, :]
        x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)  # [HEADS_PAD, HALF_PAD]
        x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        dtype = src.dtype.element_ty
        if OFFSET != 0:
            y1 = (x1 * rstd * (w1 + OFFSET)).to(dtype).to(tl.float32)
            y2 = (x2 * rstd * (w2 + OFFSET)).to(dtype).to(tl.float32)
        else:
            y1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
            y2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        at = offs_h[:, None] * (2 * HALF) + offs_d[None, :]
        return y1 * c - y2 * s, y2 * c + y1 * s, at, m
    else:
        return _rope_load(src, tok, st_t, st_h, c, s, NH, HALF, HEADS_PAD, HALF_PAD)


@triton.jit
def _rotate_q_group(
    q_ptr,  # unrotated [num_seqs, num_heads, head_dim] (strided view)
    dst_ptr,  # where head kvh * GROUP of this program's output rows starts
    seq,  # int64
    kvh,
    stride_q_seq,
    stride_q_head,
    stride_dst_head,
    c,  # [1, HALF_PAD] fp32 (_rope_tables)
    s,
    qn_w_ptr,  # QK_NORM: q's norm weight [head_dim]
    norm_eps,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    QK_NORM: tl.constexpr,
    NORM_OFFSET: tl.constexpr,
):
    """Rotates KV head kvh's GROUP query heads of sequence seq (QK_NORM: normalized first)
    and stores them rounded to the model dtype (as rotary_store_kv's q_out holds them), heads
    stride_dst_head apart."""
    first, second, _, m = _rope_load_normed(q_ptr + kvh * GROUP * stride_q_head, seq,
                                            stride_q_seq, stride_q_head, c, s, qn_w_ptr,
                                            norm_eps, GROUP, HALF, GROUP_PAD, HALF_PAD, QK_NORM,
                                            NORM_OFFSET)
    at = tl.arange(0, GROUP_PAD)[:, None] * stride_dst_head + tl.arange(0, HALF_PAD)[None, :]
    dtype = q_ptr.dtype.element_ty
    # .to(dtype) is the rounding point; the second cast is exact (dst: model dtype or fp32).
    tl.store(dst_ptr + at, first.to(dtype).to(dst_ptr.dtype.element_ty), mask=m)
    tl.store(dst_ptr + at + HALF, second.to(dtype).to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rows_of_halves(first, second):
    """[R, 2 * HALF_PAD] rows from their first and second halves ([R, HALF_PAD] each), in
    registers: the layout a head_dim vector has in memory when HALF == HALF_PAD."""
    both = tl.permute(tl.join(first, second), (0, 2, 1))  # [R, 2, HALF_PAD]
    return tl.reshape(both, [first.shape[0], 2 * first.shape[1]])


@triton.jit
def _first_row(tile):
    """Row 0 of a [2, D] tile as a [D] vector (exact: no arithmetic)."""
    row0, _ = tl.split(tl.permute(tile, (1, 0)))
    return row0


@triton.jit
def _new_kv(
    k_ptr,  # unrotated [num_seqs, num_kv_heads, head_dim] (strided view)
    v_ptr,
    k_scale_ptr,  # [num_kv_heads] fp32 (FP8_MAX > 0 only)
    v_scale_ptr,
    seq,  # int64
    kvh,
    stride_k_seq,
    stride_k_head,
    stride_v_seq,
    stride_v_head,
    c,  # [1, HALF_PAD] fp32 (_rope_tables)
    s,
    kn_w_ptr,  # QK_NORM: k's norm weight [head_dim]
    norm_eps,
    cache_dtype: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    FP8_MAX: tl.constexpr,
    QK_NORM: tl.constexpr,
    NORM_OFFSET: tl.constexpr,
):
    """Rotated k and plain v of (seq, kvh) as rotary_store_kv stores them (one head of its
    [heads, half] tiles: a 2-row tile, the second row masked): (k halves, v halves in the cache
    dtype [2, HALF_PAD] each, their offsets in a cache row, the mask)."""
    dtype = k_ptr.dtype.element_ty
    ks = 1.0
    vs = 1.0
    if FP8_MAX > 0:
        ks = tl.load(k_scale_ptr + kvh)
        vs = tl.load(v_scale_ptr + kvh)
    k1, k2, at, m = _rope_load_normed(k_ptr + kvh * stride_k_head, seq, stride_k_seq,
                                      stride_k_head, c, s, kn_w_ptr, norm_eps, 1, HALF, 2,
                                      HALF_PAD, QK_NORM, NORM_OFFSET)
    # V is not rotated; cos 1, sin 0 loads it through the same helper, as rotary_store_kv does.
    v1, v2, _, _ = _rope_load(v_ptr + kvh * stride_v_head, seq, stride_v_seq, stride_v_head, 1.0,
                              0.0, 1, HALF, 2, HALF_PAD)
    return (_to_cache(k1, ks, dtype, cache_dtype, FP8_MAX),
            _to_cache(k2, ks, dtype, cache_dtype, FP8_MAX),
            _to_cache(v1, vs, dtype, cache_dtype, FP8_MAX),
            _to_cache(v2, vs, dtype, cache_dtype, FP8_MAX), at, m)


@triton.jit
def _store_kv_halves(k_cache_ptr, v_cache_ptr, row, at, m, k1, k2, v1, v2, HALF: tl.constexpr):
    """_new_kv's halves into the cache row starting at element `row`."""
    tl.store(k_cache_ptr + row + at, k1, mask=m)
    tl.store(k_cache_ptr + row + at + HALF, k2, mask=m)
    tl.store(v_cache_ptr + row + at, v1, mask=m)
    tl.store(v_cache_ptr + row + at + HALF, v2, mask=m)


@triton.jit
def _kv_rows(k1, k2, v1, v2, dtype: tl.constexpr):
    """The stored k and v rows [2 * HALF_PAD] as the attention reads them back (upcast to the
    model dtype); the cache's bytes only when HALF == HALF_PAD."""
    return (_first_row(_rows_of_halves(k1.to(dtype), k2.to(dtype))),
            _first_row(_rows_of_halves(v1.to(dtype), v2.to(dtype))))


@triton.jit
def _rotary_prologue(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr,  # as in _decode_split_kernel
    cos_t,  # [1, HALF_PAD] fp32: the new token's rotary tables (_rope_tables)
    sin_t,
    slot,  # int64: the new token's cache slot, < 0: none
    seq,  # int64
    kvh,
    split,
    is_owner,  # this program's split holds the new token: it stores the new k, v
    stride_q_seq, stride_q_head, stride_k_seq, stride_k_head, stride_v_seq, stride_v_head,
    stride_slot, stride_out_seq, stride_out_head, stride_out_split,
    qn_w_ptr,  # QK_NORM: q's and k's per-head RMSNorm weights [head_dim]
    kn_w_ptr,
    norm_eps,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    FP8_MAX: tl.constexpr,
    Q_IN_REGISTERS: tl.constexpr,  # HALF == HALF_PAD: halves joined in registers, no scratch
    QK_NORM: tl.constexpr,  # q and k RMS-normalized per head before the rotation
    NORM_OFFSET: tl.constexpr,  # QK_NORM: Gemma 3's weight offset (0: none)
):
    """FUSED_ROTARY's first phase (module docstring): rotates the group's q, stores the new k, v
    if is_owner, and returns (q [GROUP_PAD, BLOCK_D] in the model dtype, the stored k and v rows
    [BLOCK_D] as read back from the cache: zeros unless is_owner and slot >= 0).

    Q_IN_REGISTERS: q's rotated halves are joined in registers. Otherwise (head_dim not a power
    of two: the halves' padding sits inside the row) q goes through this program's own output
    rows and is read back after a CTA barrier (the kernel overwrites them with its result)."""
    rows = out_ptr + seq * stride_out_seq + split * stride_out_split
    if Q_IN_REGISTERS:
        first, second, _, _ = _rope_load_normed(q_ptr + kvh * GROUP * stride_q_head, seq,
                                                stride_q_seq, stride_q_head, cos_t, sin_t,
                                                qn_w_ptr, norm_eps, GROUP, HALF, GROUP_PAD,
                                                HALF_PAD, QK_NORM, NORM_OFFSET)
        dtype = q_ptr.dtype.element_ty
        q = _rows_of_halves(first.to(dtype), second.to(dtype))  # [GROUP_PAD, BLOCK_D]
    else:
        _rotate_q_group(q_ptr, rows + kvh * GROUP * stride_out_head, seq, kvh, stride_q_seq,
                        stride_q_head, stride_out_head, cos_t, sin_t, qn_w_ptr, norm_eps, GROUP,
                        GROUP_PAD, HALF, HALF_PAD, QK_NORM, NORM_OFFSET)
    dtype = q_ptr.dtype.element_ty
    own = is_owner & (slot >= 0)
    row = slot * stride_slot + kvh * (2 * HALF)
    k_row = tl.zeros([BLOCK_D], dtype=dtype)
    v_row = tl.zeros([BLOCK_D], dtype=dtype)
    # The owner alone loads the new k, v, after q. (Loading them in every program before q,
    # so that the owner's loads leave the branch, measured no faster in the step:
    # benchmarks/MOE_B1.md, round 19.)
    if own:
        k1, k2, v1, v2, at, m = _new_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, seq, kvh,
                                        stride_k_seq, stride_k_head, stride_v_seq, stride_v_head,
                                        cos_t, sin_t, kn_w_ptr, norm_eps,
                                        k_cache_ptr.dtype.element_ty, HALF, HALF_PAD, FP8_MAX,
                                        QK_NORM, NORM_OFFSET)
        _store_kv_halves(k_cache_ptr, v_cache_ptr, row, at, m, k1, k2, v1, v2, HALF)
        k_row, v_row = _kv_rows(k1, k2, v1, v2, dtype)
    # Every thread passes here (outside the branch): the CTA's global writes above become
    # visible to all of its threads before anything reads them back (q's scratch; the new
    # token's row, where the tile loop reaches it).
    tl.debug_barrier()
    if not Q_IN_REGISTERS:
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
        at = (kvh * GROUP + offs_g)[:, None] * stride_out_head + offs_d[None, :]
        q = tl.load(rows + at, mask=mask, other=0.0).to(q_ptr.dtype.element_ty)
    return q, k_row, v_row


@triton.jit
def _kv_offsets(bt_row, pos, mask_n, offs_d, kv_head_off, stride_slot, PAGE: tl.constexpr):
    """[BLOCK_N, BLOCK_D] element offsets of positions `pos` ([BLOCK_N]) of one KV head in the
    paged cache, through the sequence's block-table row (positions outside mask_n: page 0)."""
    page = tl.load(bt_row + pos // PAGE, mask=mask_n, other=0).to(tl.int64)
    slot = page * PAGE + (pos % PAGE)
    return slot[:, None] * stride_slot + kv_head_off + offs_d[None, :]


@triton.jit
def _load_kv(k_cache_ptr, v_cache_ptr, kv_off, mask, dtype):
    """K and V tiles [BLOCK_N, BLOCK_D] at kv_off, zeros outside mask; fp8 caches are upcast to
    the query dtype (exact: e4m3 c bf16/fp16)."""
    k = tl.load(k_cache_ptr + kv_off, mask=mask, other=0.0).to(dtype)
    v = tl.load(v_cache_ptr + kv_off, mask=mask, other=0.0).to(dtype)
    return k, v


@triton.jit
def _attend_tile(q, k, v, mask_n, m_i, l_i, acc, qk_scale, SOFTCAP: tl.constexpr):
    """One online-softmax step: q [GROUP_PAD, BLOCK_D] against the tile's k, v [BLOCK_N,
    BLOCK_D] (positions outside mask_n [BLOCK_N] ignored); returns the new (m_i, l_i, acc).
    SOFTCAP > 0: scores soft-capped (shard/kernels/softcap.py) before the mask."""
    s = tl.dot(q, tl.trans(k)) * qk_scale  # [GROUP_PAD, BLOCK_N], log2 domain
    s = soft_cap_log2(s, SOFTCAP)
    s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# Arguments that vary from step to step in eager (mixed) steps are not specialized on: the
# decode rows of a mixed step come as block_tables[p:] and seq_lens[p:] (16-byte aligned or
# not, by p), and the block table's width is the step's longest sequence's (stride_bt may be 1,
# a multiple of 16 or neither). Specialized, each combination was a kernel variant of its own,
# compiled in the middle of serving (shard/runtime/kernel_compiles.py); these arguments feed
# only scalar and gathered loads, which their specialization does not speed up.
@triton.jit(do_not_specialize=["stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def _decode_split_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]; FUSED_ROTARY: not yet rotated
    k_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks]
    seq_lens_ptr,  # [num_seqs]
    out_ptr,  # final [num_seqs, num_heads, head_dim] (ONE_SPLIT) or partial fp32
    lse_ptr,  # [num_seqs, num_heads, num_splits] fp32 (unused when ONE_SPLIT)
    final_ptr,  # several splits: the final [num_seqs, num_heads, head_dim] output
    ticket_ptr,  # several splits: [>= num_seqs * num_kv_heads] int32, zero between launches
    k_scale_ptr,  # [num_kv_heads] fp32 (SCALED only)
    v_scale_ptr,
    k_ptr,  # FUSED_ROTARY only: new k, v [num_seqs, num_kv_heads, head_dim], k not yet rotated
    v_ptr,
    cos_ptr,  # FUSED_ROTARY only: [max_positions, head_dim] fp32 rotary tables
    sin_ptr,
    pos_ptr,  # FUSED_ROTARY only: [num_seqs] positions of the new tokens
    slot_ptr,  # FUSED_ROTARY only: [num_seqs] int64 cache slots of the new tokens, < 0: none
    stride_q_seq,
    stride_q_head,
    stride_k_seq,
    stride_k_head,
    stride_v_seq,
    stride_v_head,
    stride_cos,
    stride_bt,
    stride_slot,  # elements between consecutive cache slots (num_kv_heads * head_dim)
    stride_out_seq,
    stride_out_head,
    stride_out_split,
    stride_final_seq,
    stride_final_head,
    sm_scale_log2,  # softmax scale * log2(e)
    window,  # sliding window (positions), <= 0 for none
    warm_ptr,  # WARM: the next launch's weights, warmed into L2 (shard/kernels/l2_warm.py)
    warm_bytes,
    qn_w_ptr,  # QK_NORM (FUSED_ROTARY): q's and k's per-head RMSNorm weights [head_dim]
    kn_w_ptr,
    norm_eps,
    stamps_ptr,  # STAMPS: int64 [programs, STAMP_SLOTS], program = (seq, kv head, split) order
    NUM_SPLITS,  # runtime: one compiled kernel serves every split count
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # >= 16 for tl.dot
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,  # cache block size (tokens)
    ONE_SPLIT: tl.constexpr,
    SCALED: tl.constexpr,  # fp8 cache with per-KV-head scales
    FUSED_ROTARY: tl.constexpr,  # rotate q, k and store the new k, v first (module docstring)
    HALF: tl.constexpr,  # HEAD_DIM // 2 (FUSED_ROTARY)
    HALF_PAD: tl.constexpr,
    FP8_MAX: tl.constexpr,  # > 0 (FUSED_ROTARY): fp8 cache, store x / scale saturated
    PDL: tl.constexpr = False,  # launched as a programmatic dependent (shard/kernels/pdl.py)
    EARLY_TILE: tl.constexpr = False,  # load the first K/V tile before the wait (see _decode)
    Q_IN_REGISTERS: tl.constexpr = False,  # FUSED_ROTARY with HALF == HALF_PAD (_rotary_prologue)
    GROUP_P2: tl.constexpr = 1,  # next power of two of GROUP (_merge_splits)
    SPLITS_PAD: tl.constexpr = 1,  # next power of two of NUM_SPLITS (_merge_splits)
    SOFTCAP: tl.constexpr = 0.0,  # > 0: attention-logit soft-capping (Gemma 2), 0: none
    WARM: tl.constexpr = False,  # warm [warm_ptr, + warm_bytes) into L2 after the wait
    QK_NORM: tl.constexpr = False,  # FUSED_ROTARY: q/k RMSNorm per head first (Qwen3, Gemma 3)
    NORM_OFFSET: tl.constexpr = 0.0,  # QK_NORM: the weight applied is (NORM_OFFSET + w)
    STAMPS: tl.constexpr = False,  # record STAMP_POINTS (shard/kernels/stamps.py)
    MERGE_BY_SPLIT: tl.constexpr = False,  # _merge_splits' form (merge_by_split)
):
    # Latency-bound at decode batch sizes: let the next kernel launch now. Before the wait on
    # the previous kernel (q/k/v's GEMV, or the rotary + store kernel) only what it cannot have
    # written is read: the step's inputs (copied in before any kernel of the step ran), the fp8
    # scales, and (EARLY_TILE) the first tile's cache rows of earlier tokens; so their DRAM
    # latency, the block table's and that tile's included, overlaps that kernel.
    let_dependents_launch(PDL)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    program = program_index()  # (seq, kvh, split), the split fastest
    stamp(stamps_ptr, program, 0, STAMPS)
    # fp8: K = stored * k_scale, V = stored * v_scale for this program's KV head; both scales are
    # folded in exactly (scores * k_scale, output * v_scale) instead of scaling every element.
    qk_scale = sm_scale_log2
    v_mul = 1.0
    if SCALED:
        qk_scale = sm_scale_log2 * tl.load(k_scale_ptr + kvh)
        v_mul = tl.load(v_scale_ptr + kvh)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if window > 0:
        lo = tl.maximum(seq_len - window, 0)
    # This split's share of [lo, seq_len), rounded up to whole tiles. (Finer shares, and half-width
    # tiles for shares within half a tile, measured no faster in the step: benchmarks/MOE_B1.md,
    # round 19.)
    span = seq_len - lo
    chunk = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kvh * HEAD_DIM
    dtype = q_ptr.dtype.element_ty
    if FUSED_ROTARY:
        cos_t, sin_t = _rope_tables(cos_ptr, sin_ptr, pos_ptr, seq.to(tl.int64), stride_cos,
                                    dtype, HALF, HALF_PAD)  # [1, HALF_PAD] each
        new_slot = tl.load(slot_ptr + seq).to(tl.int64)
    if EARLY_TILE:
        # The first tile without the new token's row (position seq_len - 1, written by the
        # previous kernel or, FUSED_ROTARY, by this very kernel below).
        first_pos = start + offs_n  # [BLOCK_N]
        first_in = first_pos < end
        first_new = first_in & (first_pos == seq_len - 1)
        first_off = _kv_offsets(bt_row, first_pos, first_in, offs_d, kv_head_off, stride_slot,
                                PAGE)
        k_first, v_first = _load_kv(k_cache_ptr, v_cache_ptr, first_off,
                                    (first_in & ~first_new)[:, None] & mask_d[None, :], dtype)
    wait_for_predecessor(PDL)
    stamp(stamps_ptr, program, 1, STAMPS)

    if FUSED_ROTARY:
        # The split holding the new token (position seq_len - 1) stores its k, v; split 0 when
        # the row is empty, so that the cache matches rotary_store_kv for any slot_mapping.
        owner = tl.where(span > 0, (seq_len - 1 - lo) // tl.maximum(chunk, 1), 0)
        q, k_new, v_new = _rotary_prologue(
            q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
            cos_t, sin_t, new_slot, seq.to(tl.int64), kvh, split, split == owner,
            stride_q_seq, stride_q_head, stride_k_seq, stride_k_head, stride_v_seq, stride_v_head,
            stride_slot, stride_out_seq, stride_out_head, stride_out_split, qn_w_ptr, kn_w_ptr,
            norm_eps, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, HALF, HALF_PAD, FP8_MAX, Q_IN_REGISTERS,
            QK_NORM, NORM_OFFSET,
        )  # q [GROUP_PAD, BLOCK_D]; the stored new k, v rows [BLOCK_D] (owner only)
    else:
        q = tl.load(
            q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head
            + offs_d[None, :],
            mask=mask_g[:, None] & mask_d[None, :],
            other=0.0,
        )  # [GROUP_PAD, BLOCK_D]
    stamp(stamps_ptr, program, 2, STAMPS)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    loop_start = start
    if EARLY_TILE:
        if start < end:  # (an empty split attends to nothing)
            # The new token's row now, where the first tile holds it, in place of the zeros the
            # early load left there: the rows this program just stored, from registers
            # (Q_IN_REGISTERS), else read back from the cache (FUSED_ROTARY: after the
            # prologue's barrier). A fused step without a slot for it (not one the engine
            # makes) reads whatever the cache holds there, as the unfused pair does.
            reload = first_new
            if Q_IN_REGISTERS:
                stored = first_new & (new_slot >= 0)
                reload = first_new & (new_slot < 0)
                k_first = tl.where(stored[:, None], k_new[None, :], k_first)
                v_first = tl.where(stored[:, None], v_new[None, :], v_first)
            k_re, v_re = _load_kv(k_cache_ptr, v_cache_ptr, first_off,
                                  reload[:, None] & mask_d[None, :], dtype)
            k_first = tl.where(reload[:, None], k_re, k_first)
            v_first = tl.where(reload[:, None], v_re, v_first)
            m_i, l_i, acc = _attend_tile(q, k_first, v_first, first_in, m_i, l_i, acc, qk_scale,
                                         SOFTCAP)
        loop_start = start + BLOCK_N
    for tile in range(loop_start, end, BLOCK_N):
        pos = tile + offs_n  # [BLOCK_N]
        mask_n = pos < end
        kv_off = _kv_offsets(bt_row, pos, mask_n, offs_d, kv_head_off, stride_slot, PAGE)
        k, v = _load_kv(k_cache_ptr, v_cache_ptr, kv_off, mask_n[:, None] & mask_d[None, :],
                        dtype)
        m_i, l_i, acc = _attend_tile(q, k, v, mask_n, m_i, l_i, acc, qk_scale, SOFTCAP)
    stamp(stamps_ptr, program, 3, STAMPS)

    # The o_proj GEMV's weights stream into L2 while the partial store, the ticket and the
    # merge run. Not earlier: the prefetch's HBM requests would queue ahead of this program's
    # own K/V loads (measured: warming right after the wait made the step 7 us a layer slower).
    programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    warm_share(warm_ptr, warm_bytes, program, programs, WARM)
    if FUSED_ROTARY and not Q_IN_REGISTERS:
        # Every thread has read its q (the scratch) before any thread overwrites it below.
        tl.debug_barrier()
    out_mask = mask_g[:, None] & mask_d[None, :]
    out_off = (
        seq.to(tl.int64) * stride_out_seq
        + heads[:, None] * stride_out_head
        + split * stride_out_split
        + offs_d[None, :]
    )
    if SCALED:
        acc = acc * v_mul
    if ONE_SPLIT:
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        tl.store(
            out_ptr + out_off, (acc / safe_l[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask
        )
        stamp(stamps_ptr, program, 7, STAMPS)
    else:
        # Unnormalised partial output and its log2-sum-exp (-inf for an empty split).
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        tl.store(out_ptr + out_off, acc / safe_l[:, None], mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        num_heads = tl.num_programs(1) * GROUP
        lse_off = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(lse_ptr + lse_off, lse, mask=mask_g)
        # The split that finishes last merges (no second kernel: one launch and one PDL hop
        # fewer per layer). Every thread's stores above precede the ticket; the acq_rel atomic
        # publishes them to (and, for the last split, acquires the others' from) the whole GPU.
        tl.debug_barrier()
        stamp(stamps_ptr, program, 4, STAMPS)
        ticket_at = ticket_ptr + seq * tl.num_programs(1) + kvh
        ticket = tl.atomic_add(ticket_at, 1, sem="acq_rel", scope="gpu")
        stamp(stamps_ptr, program, 5, STAMPS)
        if ticket == NUM_SPLITS - 1:
            tl.store(ticket_at, 0)  # every split has taken its ticket: reset for the next launch
            _merge_splits(out_ptr, lse_ptr, final_ptr, seq.to(tl.int64), kvh, num_heads,
                          NUM_SPLITS, stride_out_seq, stride_out_head, stride_out_split,
                          stride_final_seq, stride_final_head, GROUP, GROUP_P2, SPLITS_PAD,
                          HEAD_DIM, BLOCK_D, MERGE_BY_SPLIT)
            stamp(stamps_ptr, program, 6, STAMPS)


@triton.jit
def _merge_splits(
    part_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32, normalised per split
    lse_ptr,  # [num_seqs, num_heads, num_splits] fp32 (log2 domain, -inf: empty split)
    out_ptr,  # [num_seqs, num_heads, head_dim], the model dtype
    seq,  # int64
    kvh,
    num_heads,
    NUM_SPLITS,
    stride_part_seq,
    stride_part_head,
    stride_part_split,
    stride_out_seq,
    stride_out_head,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BY_SPLIT: tl.constexpr = False,
):
    """Merges the splits of KV head kvh's query heads of one sequence (run by the split kernel's
    program that finishes last): o = sum_s w_s * part_s / sum_s w_s,
    w_s = 2^(lse_s - max lse). The other programs wrote the partials: loaded past the L1
    (.cg), which is not coherent across SMs and may hold an earlier step's lines.
    BY_SPLIT: the partials are read and weighted one split's [GROUP, head_dim] rows at a time
    (independent loads, so still all in flight) instead of as one [splits, GROUP, head_dim]
    block, whose values and addresses one program holds at once (128 fp32 a thread at 16 x 8 x
    128 with 4 warps) and whose split sum crosses warps."""
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_g = tl.arange(0, GROUP_P2)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g  # [GROUP_P2]
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    mask_sg = (offs_s < NUM_SPLITS)[:, None] & mask_g[None, :]  # [SPLITS_PAD, GROUP_P2]
    lse_at = lse_ptr + (seq * num_heads + heads) * NUM_SPLITS  # [GROUP_P2]
    lse = tl.load(lse_at[None, :] + offs_s[:, None], mask=mask_sg, other=float("-inf"),
                  cache_modifier=".cg")
    m = tl.max(lse, 0)  # [GROUP_P2]
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m[None, :])  # 0 for empty splits
    denom = tl.sum(w, 0)
    denom = tl.where(denom > 0, denom, 1.0)
    part_at = part_ptr + seq * stride_part_seq + heads[:, None] * stride_part_head + offs_d[None, :]
    if BY_SPLIT:
        o = tl.zeros([GROUP_P2, BLOCK_D], tl.float32)
        for s in tl.static_range(SPLITS_PAD):
            here = mask_g & (offs_g * 0 + s < NUM_SPLITS)  # [GROUP_P2] (a tensor, not a bool)
            w_s = tl.exp2(tl.load(lse_at + s, mask=here, other=float("-inf"),
                                  cache_modifier=".cg") - m)
            part_s = tl.load(part_at + s * stride_part_split,
                             mask=here[:, None] & mask_d[None, :], other=0.0,
                             cache_modifier=".cg")  # [GROUP_P2, BLOCK_D]
            o += part_s * w_s[:, None]
        o = o / denom[:, None]
    else:
        part = tl.load(
            part_at[None, :, :] + offs_s[:, None, None] * stride_part_split,
            mask=mask_sg[:, :, None] & mask_d[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )  # [SPLITS_PAD, GROUP_P2, BLOCK_D]
        o = tl.sum(part * w[:, :, None], 0) / denom[:, None]  # [GROUP_P2, BLOCK_D]
    tl.store(
        out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=mask_g[:, None] & mask_d[None, :],
    )


# The split kernel's merge counters, one per (sequence, KV head) of a launch
# (shard/kernels/tickets.py). Default split counts split only batches of fewer than num_sms
# (sequence, KV head) pairs, well inside the first allocation; larger explicit counts grow it.
_TICKETS = TicketCounters("decode attention", 1024)


# A/B only (q_through_memory): FUSED_ROTARY's q path of head_dims that are not powers of two,
# forced onto every head_dim
_Q_THROUGH_MEMORY = Setting(False)


# _merge_splits' BY_SPLIT form, on: at batch 1 of Qwen3-30B-A3B's attention (16 splits x 8 query
# heads x 128) the merge took 3.5 us in one [splits, group, head_dim] block and 1.0 us one split
# at a time, measured inside the kernel (benchmarks/attention_stamps.py, H200, round 18 of
# benchmarks/MOE_B1.md); the A/B switch keeps the block form for benchmarks.
_MERGE_BY_SPLIT = Setting(True)


def merge_by_split(on: bool) -> AbstractContextManager[None]:
    """Inside the block the split kernel's merge reads the partials one split at a time (on, the
    default; _merge_splits' BY_SPLIT) or as one block (off); capture a CUDA graph under the
    setting it is replayed with."""
    return _MERGE_BY_SPLIT.override(on)


def q_through_memory() -> AbstractContextManager[None]:
    """Inside the block the fused mode parks the rotated q in its output rows and reads it back
    (_rotary_prologue) whatever the head_dim: benchmarks compare it with the register path in
    one process (shard/kernels/setting.py)."""
    return _Q_THROUGH_MEMORY.override(True)


# The split kernel's stamp points (shard/kernels/stamps.py; `stamps=` of the launches below), in
# program order. A program that merges stamps 6; a one-split launch stamps 7 instead of 4-6.
STAMP_POINTS = ("start", "after the PDL wait", "q ready (after the rotary prologue)",
                "tiles attended", "partials stored", "ticket taken", "merged", "output stored")


def decode_tile(head_dim: int) -> int:
    """K/V positions per tile (BLOCK_N): 64 up to head_dim 128 (measured, benchmarks/NOTES.md);
    32 beyond (Gemma's 256), so that the pipelined K and V tiles (3 stages of 2 x BLOCK_N x
    head_dim x 2 bytes) stay well inside a Hopper SM's 227 KB of shared memory."""
    return 64 if head_dim <= 128 else 32


def default_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Split count from the batch shape alone (so captured graphs stay valid).

    Measured on H200 (benchmarks/NOTES.md): once there is a (sequence, KV head) program per SM,
    one split is fastest (no merge pass); below that, about four programs per SM.
    """
    programs = max(num_seqs * num_kv_heads, 1)
    if programs >= num_sms:
        return 1
    return int(min(triton.cdiv(4 * num_sms, programs), 16))


@dataclass(frozen=True)
class _NewTokens:
    """The FUSED_ROTARY inputs: each sequence's new token before rotary and the cache store."""

    key: torch.Tensor  # [num_seqs, num_kv_heads, head_dim], not yet rotated (strided view)
    value: torch.Tensor  # [num_seqs, num_kv_heads, head_dim]
    positions: torch.Tensor  # [num_seqs] int
    cos: torch.Tensor  # [max_positions, head_dim] fp32 (shard.layers.rotary.RotaryEmbedding)
    sin: torch.Tensor
    slot_mapping: torch.Tensor  # [num_seqs] int64, < 0: padding row (nothing stored)
    head_norms: HeadNorms | None = None  # q/k RMSNorm per head before the rotation


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32 (0 = padding row: output is zeros)
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,  # None: by head_dim (decode_tile)
    num_warps: int = 4,
    num_stages: int = 3,
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32: fp8 caches with scales
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    warm: torch.Tensor | None = None,  # the next launch's weights: into L2 (l2_warm.py)
    stamps: torch.Tensor | None = None,  # int64 [programs, STAMP_SLOTS]: STAMP_POINTS recorded
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of one new query token per sequence over its whole paged context (the last
    sliding_window positions only, where given)."""
    if out is None:
        out = torch.empty_like(query)
    return _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window,
                   num_splits, out, block_n, num_warps, num_stages, k_scale, v_scale, None,
                   softcap, warm, stamps)


def rotary_store_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], not yet rotated (strided view)
    key: torch.Tensor,  # [num_seqs, num_kv_heads, head_dim], not yet rotated (strided view)
    value: torch.Tensor,  # [num_seqs, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_seqs] int, the new tokens' positions
    cos: torch.Tensor,  # [max_positions, head_dim] fp32 (shard.layers.rotary.RotaryEmbedding)
    sin: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_seqs] int64, < 0: padding row (nothing stored)
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, incl. the new token (0 = padding row)
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # must not overlap query, key or value
    block_n: int | None = None,  # None: by head_dim (decode_tile)
    num_warps: int = 4,
    num_stages: int = 3,
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32: fp8 caches with scales
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    warm: torch.Tensor | None = None,  # the next launch's weights: into L2 (l2_warm.py)
    head_norms: HeadNorms | None = None,  # q/k RMSNorm per head before the rotation
    stamps: torch.Tensor | None = None,  # int64 [programs, STAMP_SLOTS]: STAMP_POINTS recorded
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """(head_norms: shard.kernels.qk_norm.qk_rms_norm, then) shard.kernels.elementwise.
    rotary_store_kv then paged_decode_attention, in the split kernel itself
    (the module docstring's fused mode): one launch fewer, the same output and cache contents,
    bit for bit. fp8 caches store x / scale per KV head (scales None: 1.0)."""
    num_seqs, num_heads, head_dim = query.shape
    assert head_dim % 2 == 0 and cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert query.stride(2) == 1 and key.stride(2) == 1 and value.stride(2) == 1
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    if out is None:
        out = torch.empty((num_seqs, num_heads, head_dim), dtype=query.dtype, device=query.device)
    new = _NewTokens(key, value, positions, cos, sin, slot_mapping, head_norms)
    return _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window,
                   num_splits, out, block_n, num_warps, num_stages, k_scale, v_scale, new,
                   softcap, warm, stamps)


def _decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim] (new is not None: not yet rotated)
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None,
    num_splits: int | None,
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim], head_dim contiguous
    block_n: int | None,
    num_warps: int,
    num_stages: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    new: _NewTokens | None,  # FUSED_ROTARY inputs, None: query is rotated, the cache written
    softcap: float | None = None,  # > 0: attention-logit soft-capping
    warm: torch.Tensor | None = None,  # warmed into L2 after the kernel's PDL wait
    stamps: torch.Tensor | None = None,  # int64 [>= programs, STAMP_SLOTS] (STAMP_POINTS)
) -> torch.Tensor:
    """Launches the split kernel (its last split per sequence and KV head merges). Host work only:
    no syncs; the temporaries depend on the batch shape alone (CUDA-graph capture)."""
    num_seqs, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    if num_seqs == 0:
        return out
    if num_splits is None:
        sms = torch.cuda.get_device_properties(query.device).multi_processor_count
        num_splits = default_num_splits(num_seqs, num_kv_heads, sms)
    block_d = triton.next_power_of_2(head_dim)
    if block_n is None:
        block_n = decode_tile(head_dim)
    one = num_splits == 1
    scaled = k_scale is not None and v_scale is not None
    if one:
        part, lse = out, out  # lse unused
        s_seq, s_head, s_split = out.stride(0), out.stride(1), 0
    else:
        part = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        s_seq, s_head, s_split = part.stride(0), part.stride(1), part.stride(2)
    # (Allocated at the first call whatever the split count: a CUDA-graph warm-up runs only the
    # largest batch, with one split, before the smaller, split batches are captured.)
    tickets = _TICKETS.take(query.device, 0 if one else num_seqs * num_kv_heads)
    # Pointer arguments that the compiled variant never reads: the ticket counters (int32 as
    # seq_lens was, allocated once, 16-byte aligned). Not seq_lens: a mixed step passes
    # seq_lens[p:], aligned or not by p, and each of these eight arguments' alignment would be
    # a kernel variant of its own, compiled in the middle of serving.
    dummy = tickets
    k_store_scale, v_store_scale, fp8_max = k_scale, v_scale, 0.0
    if new is not None and key_cache.element_size() == 1:  # the store divides by the scales
        fp8_max = float(torch.finfo(key_cache.dtype).max)
        if k_store_scale is None or v_store_scale is None:
            ones = torch.ones(num_kv_heads, dtype=torch.float32, device=query.device)
            k_store_scale, v_store_scale = ones, ones
    fused = new is not None
    norms = new.head_norms if new is not None else None
    if stamps is None:  # inside stamps.recording: this launch's rows (else None)
        stamps = take_stamps("attention", num_seqs * num_kv_heads * num_splits, STAMP_POINTS)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        part,
        lse,
        out,
        tickets,
        k_store_scale if scaled or fp8_max > 0 else dummy,
        v_store_scale if scaled or fp8_max > 0 else dummy,
        new.key if fused else dummy,
        new.value if fused else dummy,
        new.cos if fused else dummy,
        new.sin if fused else dummy,
        new.positions if fused else dummy,
        new.slot_mapping if fused else dummy,
        query.stride(0),
        query.stride(1),
        new.key.stride(0) if fused else 0,
        new.key.stride(1) if fused else 0,
        new.value.stride(0) if fused else 0,
        new.value.stride(1) if fused else 0,
        new.cos.stride(0) if fused else 0,
        block_tables.stride(0),
        num_kv_heads * head_dim,
        s_seq,
        s_head,
        s_split,
        out.stride(0),
        out.stride(1),
        scale * LOG2E,
        sliding_window or 0,
        *warm_launch_args(warm, dummy),
        norms.q_weight if norms is not None else dummy,
        norms.k_weight if norms is not None else dummy,
        norms.eps if norms is not None else 0.0,
        stamps if stamps is not None else dummy,
        NUM_SPLITS=num_splits,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        PAGE=page,
        ONE_SPLIT=one,
        SCALED=scaled,
        FUSED_ROTARY=fused,
        HALF=head_dim // 2,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        FP8_MAX=fp8_max,
        # Only batch 1's q/k/v GEMV is itself a PDL launch that lets this kernel start early
        # (shard/kernels/gemv.py); elsewhere the early tile just sits in registers (batch 8: step
        # 4.25 -> 4.48 ms fp8, benchmarks/QUANT_TP.md).
        EARLY_TILE=num_seqs == 1,
        Q_IN_REGISTERS=fused and head_dim // 2 == triton.next_power_of_2(head_dim // 2)
        and not _Q_THROUGH_MEMORY.value,
        GROUP_P2=triton.next_power_of_2(group),
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        SOFTCAP=float(softcap or 0.0),
        WARM=warm is not None,
        QK_NORM=norms is not None,
        NORM_OFFSET=float(norms.offset) if norms is not None else 0.0,
        STAMPS=stamps is not None,
        MERGE_BY_SPLIT=_MERGE_BY_SPLIT.value,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl.launch_options(query.device),
    )
    return out
