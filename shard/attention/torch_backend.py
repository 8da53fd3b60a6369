"""Portable attention over the paged KV cache in plain torch (CPU and CUDA).

Loops over sequences with host-side lengths (a decode-only step is one padded call instead); each
call is SDPA's fused kernel, or with attention-logit soft-capping (which SDPA lacks) the same
attention written out (_softcapped_sdpa). The GPU kernels implement the same interface
(shard/attention/base.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shard.attention.base import AttentionBackend, AttentionMetadata
from shard.quantization.kv_cache import KvScales, dequantize_kv, is_fp8_cache, write_kv


class TorchAttentionBackend(AttentionBackend):
    """AttentionBackend in plain torch (see shard/attention/base.py for the contract)."""

    name = "torch"
    graph_safe = False  # attend loops over host-side lengths
    fuse_rotary_into_decode = False  # no fused kernel: the composed form is the same work
    fuses_qk_norm_into_decode = False

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        kv_scales: KvScales | None = None,  # fp8 caches: per-KV-head scales
    ) -> None:
        if is_fp8_cache(key_cache):  # --kv-cache-dtype fp8: x / scale, saturating
            write_kv(key, value, key_cache, value_cache, slot_mapping, kv_scales)
            return
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        kv_scales: KvScales | None = None,
        softcap: float | None = None,
        warm: torch.Tensor | None = None,  # nothing to warm on CPU
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        # 4-D inputs with enable_gqa (no repeat of K/V over the query group) and a mask only
        # where causality needs one: SDPA then takes its fused (flash) CPU kernel, not the math
        # path's bmm + softmax + bmm (several times faster per layer on CPU).
        if meta.is_decode_only and meta.num_seqs > 1:
            return self._attend_decode(query, key_cache, value_cache, meta, scale,
                                       sliding_window, kv_scales, softcap)
        block_size = key_cache.shape[1]
        out = torch.empty_like(query)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            q = query[start : start + q_len]  # [q_len, num_heads, head_dim]
            blocks = meta.block_tables[i, : -(-seq_len // block_size)].long()
            k, v = _gather(key_cache, value_cache, blocks, seq_len, q.dtype, kv_scales)
            mask, causal = None, False  # one query row at the end sees the whole context
            if (sliding_window is not None and seq_len > sliding_window) or 1 < q_len < seq_len:
                q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
                k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
                mask = k_pos <= q_pos  # [q_len, seq_len]
                if sliding_window is not None:
                    mask &= q_pos - k_pos < sliding_window
            elif q_len > 1:  # a whole prompt (no cached prefix): the plain causal mask
                causal = True
            o = _sdpa(
                q.transpose(0, 1).unsqueeze(0),  # [1, num_heads, q_len, head_dim]
                k.transpose(0, 1).unsqueeze(0),  # [1, num_kv_heads, seq_len, head_dim]
                v.transpose(0, 1).unsqueeze(0),
                mask, causal, scale, softcap,
            )
            out[start : start + q_len] = o[0].transpose(0, 1)
            start += q_len
        return out

    def _attend_decode(
        self,
        query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one new token per sequence
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        kv_scales: KvScales | None,
        softcap: float | None,
    ) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
        """A decode-only step as one SDPA call over the batch: every sequence's context is
        gathered into [num_seqs, max_seq_len] (padded), padding masked out."""
        n, block_size = meta.num_seqs, key_cache.shape[1]
        width = -(-meta.max_seq_len // block_size)
        blocks = meta.block_tables[:, :width].long().flatten()  # [num_seqs * width]
        k, v = _gather(key_cache, value_cache, blocks, None, query.dtype, kv_scales)
        length = width * block_size
        k = k.view(n, length, *k.shape[1:])  # [num_seqs, length, num_kv_heads, head_dim]
        v = v.view(n, length, *v.shape[1:])
        k_pos = torch.arange(length, device=query.device).unsqueeze(0)  # [1, length]
        seq_lens = meta.seq_lens.unsqueeze(1)  # [num_seqs, 1]
        mask = k_pos < seq_lens  # [num_seqs, length]: the query is at position seq_len - 1
        if sliding_window is not None:
            mask &= k_pos >= seq_lens - sliding_window
        o = _sdpa(
            query.unsqueeze(2),  # [num_seqs, num_heads, 1, head_dim]
            k.transpose(1, 2),  # [num_seqs, num_kv_heads, length, head_dim]
            v.transpose(1, 2),
            mask[:, None, None, :], False, scale, softcap,
        )
        return o.squeeze(2)


def _sdpa(
    q: torch.Tensor,  # [batch, num_heads, q_len, head_dim]
    k: torch.Tensor,  # [batch, num_kv_heads, kv_len, head_dim]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # bool, broadcastable to [batch, num_heads, q_len, kv_len]
    causal: bool,  # the plain causal mask (q_len == kv_len), mask is None
    scale: float,
    softcap: float | None,
) -> torch.Tensor:  # [batch, num_heads, q_len, head_dim]
    """SDPA's fused kernel (grouped-query), or with soft-capping the written-out form."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=True)
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return _softcapped_sdpa(q, k, v, mask, scale, softcap)


def _softcapped_sdpa(
    q: torch.Tensor,  # [batch, num_heads, q_len, head_dim]
    k: torch.Tensor,  # [batch, num_kv_heads, kv_len, head_dim]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # bool, broadcastable to [batch, num_heads, q_len, kv_len]
    scale: float,
    softcap: float,
) -> torch.Tensor:  # [batch, num_heads, q_len, head_dim]
    """Attention with scores softcap * tanh(q.k * scale / softcap), as transformers' eager
    Gemma 2 attention computes it (the softmax in float32, its weights back in the query dtype
    before the product with V); the mask applies after the cap."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [batch, heads, q_len, kv_len]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _gather(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    blocks: torch.Tensor,  # [n] int64 block ids
    length: int | None,  # keep the first `length` slots (None: all n * block_size)
    dtype: torch.dtype,
    kv_scales: KvScales | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # each [length, num_kv_heads, head_dim] in dtype
    """The given blocks' keys and values, concatenated in order (fp8 caches dequantized)."""
    k = key_cache.index_select(0, blocks).flatten(0, 1)[:length]
    v = value_cache.index_select(0, blocks).flatten(0, 1)[:length]
    if is_fp8_cache(key_cache):  # stored * per-head scale
        s = kv_scales or KvScales()
        return dequantize_kv(k, s.k_scale, dtype), dequantize_kv(v, s.v_scale, dtype)
    return k.to(dtype), v.to(dtype)
