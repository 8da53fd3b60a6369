"""Triton prefill attention over packed ragged sequences, reading K/V from the paged cache.

The step's new K/V are written to the cache first (slot-mapped store), so a prefill chunk that
continues a sequence whose earlier tokens are cached (chunked prefill, prefix-cache hits) is the
same case as a fresh prompt: queries at positions [seq_len - q_len, seq_len) attend causally to
cache positions [0, seq_len). FlashAttention-2 style online softmax; one program per
(sequence, BLOCK_M query tile, query head). Imported only on CUDA machines.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard.kernels.softcap import soft_cap_log2

LOG2E = 1.4426950408889634


# The block table's width (stride_bt) and the tile map's length (num_tiles) change with every
# step: not specialized on (1 / a multiple of 16 / neither), or each would be a kernel variant
# compiled in the middle of serving (shard/runtime/kernel_compiles.py).
@triton.jit(do_not_specialize=["stride_bt", "num_tiles"])
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_slots, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks]
    query_start_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    tile_map_ptr,  # [2, num_tiles] int32 (sequence, query tile) of each program (TILE_MAP only)
    k_scale_ptr,  # [num_kv_heads] fp32 (SCALED only)
    v_scale_ptr,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_bt,
    stride_slot,
    num_tiles,  # TILE_MAP only: the map's row length
    sm_scale_log2,
    window,  # <= 0: none
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    SCALED: tl.constexpr,  # fp8 cache with per-KV-head scales (folded: scores, output)
    SOFTCAP: tl.constexpr = 0.0,  # > 0: attention-logit soft-capping (Gemma 2), 0: none
    TILE_MAP: tl.constexpr = False,  # grid (num_heads, num_tiles) over the map's tiles
):
    if TILE_MAP:
        # Heads vary fastest: the query heads of one GQA group read the same K/V tiles at about
        # the same time (L2 hits), and no program is launched for a tile that does not exist.
        head = tl.program_id(0)
        t = tl.program_id(1)
        seq = tl.load(tile_map_ptr + t)
        tile_m = tl.load(tile_map_ptr + num_tiles + t)
    else:
        seq = tl.program_id(0)
        tile_m = tl.program_id(1)
        head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # tokens already cached before this chunk
    kvh = head // GROUP
    qk_scale = sm_scale_log2
    v_mul = 1.0
    if SCALED:
        qk_scale = sm_scale_log2 * tl.load(k_scale_ptr + kvh)
        v_mul = tl.load(v_scale_ptr + kvh)

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # index within the chunk
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    pos_m = ctx + offs_m  # [BLOCK_M] absolute positions
    tok = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    hi = tl.minimum(seq_len, ctx + (tile_m + 1) * BLOCK_M)
    lo = 0
    if window > 0:
        lo = tl.maximum(ctx + tile_m * BLOCK_M - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kvh * HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        pos_n = start_n + offs_n
        mask_n = pos_n < hi
        page = tl.load(bt_row + pos_n // PAGE, mask=mask_n, other=0).to(tl.int64)
        slot = page * PAGE + (pos_n % PAGE)
        kv_off = slot[:, None] * stride_slot + kv_head_off + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)  # fp8: upcast
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N]
        s = soft_cap_log2(s, SOFTCAP)  # before the mask: tanh(-inf) is finite
        allowed = (pos_n[None, :] <= pos_m[:, None]) & mask_n[None, :]
        if window > 0:
            allowed = allowed & (pos_m[:, None] - pos_n[None, :] < window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if SCALED:
        o = o * v_mul
    tl.store(
        out_ptr + tok[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def prefill_tiles(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_stages) by head_dim: 64/64/3 up to 128 (measured); 32/32/2 beyond
    (Gemma's 256), where a 64 x 256 query tile, K/V tiles in three stages and the fp32
    accumulator would not fit an SM's shared memory and registers."""
    return (64, 64, 3) if head_dim <= 128 else (32, 32, 2)


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    # 64/64/4 warps/3 stages measured fastest of four configs for 1x4096 and 16x512 (H200), up
    # to head_dim 128; None: that, or 32/32/2 stages beyond (prefill_tiles).
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32: fp8 caches with scales
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    # [2, num_tiles] int32 (sequence, query tile) per program, tiles of block_m rows
    # (shard/attention/mixed_step.py's prefill_tile_map); None: a [num_seqs, max tiles] grid.
    tile_map: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its cached context plus themselves
    (each query's last sliding_window positions only, where given)."""
    num_tokens, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = key_cache.shape
    tiles = prefill_tiles(head_dim)
    block_m = tiles[0] if block_m is None else block_m
    block_n = tiles[1] if block_n is None else block_n
    num_stages = tiles[2] if num_stages is None else num_stages
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if tile_map is not None:
        grid = (num_heads, tile_map.shape[1])
    else:
        grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    scaled = k_scale is not None and v_scale is not None
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        tile_map if tile_map is not None else seq_lens,  # unused pointer without a map
        k_scale if scaled else seq_lens,  # unused pointers when not SCALED
        v_scale if scaled else seq_lens,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        num_kv_heads * head_dim,
        tile_map.shape[1] if tile_map is not None else 0,
        scale * LOG2E,
        sliding_window or 0,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(max(head_dim, 16)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PAGE=page,
        SCALED=scaled,
        SOFTCAP=float(softcap or 0.0),
        TILE_MAP=tile_map is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
