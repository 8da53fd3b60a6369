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
- partial results (unnormalised output + log-sum-exp per split) are merged by a second small
  kernel; with one split the first kernel writes the final output directly.

Imported only on CUDA machines (triton is not needed on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
def _decode_split_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks]
    seq_lens_ptr,  # [num_seqs]
    out_ptr,  # final [num_seqs, num_heads, head_dim] (ONE_SPLIT) or partial fp32
    lse_ptr,  # [num_seqs, num_heads, num_splits] fp32 (unused when ONE_SPLIT)
    k_scale_ptr,  # [num_kv_heads] fp32 (SCALED only)
    v_scale_ptr,
    stride_q_seq,
    stride_q_head,
    stride_bt,
    stride_slot,  # elements between consecutive cache slots (num_kv_heads * head_dim)
    stride_out_seq,
    stride_out_head,
    stride_out_split,
    sm_scale_log2,  # softmax scale * log2(e)
    window,  # sliding window (positions), <= 0 for none
    NUM_SPLITS,  # runtime: one compiled kernel serves every split count
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # >= 16 for tl.dot
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,  # cache block size (tokens)
    ONE_SPLIT: tl.constexpr,
    SCALED: tl.constexpr,  # fp8 cache with per-KV-head scales
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
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
    # This split's share of [lo, seq_len), rounded up to whole tiles.
    span = seq_len - lo
    chunk = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )  # [GROUP_PAD, BLOCK_D]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kvh * HEAD_DIM
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n  # [BLOCK_N]
        mask_n = pos < end
        page = tl.load(bt_row + pos // PAGE, mask=mask_n, other=0).to(tl.int64)
        slot = page * PAGE + (pos % PAGE)
        kv_off = slot[:, None] * stride_slot + kv_head_off + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        # [BLOCK_N, BLOCK_D]; fp8 caches are upcast to the query dtype (exact: e4m3 c bf16/fp16)
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [GROUP_PAD, BLOCK_N], log2 domain
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

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
    else:
        # Unnormalised partial output and its log2-sum-exp (-inf for an empty split).
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        tl.store(out_ptr + out_off, acc / safe_l[:, None], mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        num_heads = tl.num_programs(1) * GROUP
        lse_off = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(lse_ptr + lse_off, lse, mask=mask_g)


@triton.jit
def _decode_merge_kernel(
    part_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32, normalised per split
    lse_ptr,  # [num_seqs, num_heads, num_splits] fp32 (log2 domain)
    out_ptr,  # [num_seqs, num_heads, head_dim]
    stride_out_seq,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    base = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(lse_ptr + base + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # 0 for empty splits
    denom = tl.sum(w, 0)
    denom = tl.where(denom > 0, denom, 1.0)
    part = tl.load(
        part_ptr + (base + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
        mask=mask_s[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    o = tl.sum(part * w[:, None], 0) / denom
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_out_seq + head * stride_out_head + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def default_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Split count from the batch shape alone (so captured graphs stay valid).

    Measured on H200 (benchmarks/NOTES.md): once there is a (sequence, KV head) program per SM,
    one split is fastest (no merge pass); below that, about four programs per SM.
    """
    programs = max(num_seqs * num_kv_heads, 1)
    if programs >= num_sms:
        return 1
    return int(min(triton.cdiv(4 * num_sms, programs), 16))


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
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32: fp8 caches with scales
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of one new query token per sequence over its whole paged context."""
    num_seqs, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if num_splits is None:
        sms = torch.cuda.get_device_properties(query.device).multi_processor_count
        num_splits = default_num_splits(num_seqs, num_kv_heads, sms)
    block_d = triton.next_power_of_2(head_dim)
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
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        part,
        lse,
        k_scale if scaled else seq_lens,  # unused pointers when not SCALED
        v_scale if scaled else seq_lens,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        num_kv_heads * head_dim,
        s_seq,
        s_head,
        s_split,
        scale * LOG2E,
        sliding_window or 0,
        NUM_SPLITS=num_splits,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        PAGE=page,
        ONE_SPLIT=one,
        SCALED=scaled,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if not one:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part,
            lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out
