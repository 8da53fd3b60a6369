"""Portable attention over the paged KV cache in plain torch (CPU and CUDA).

Loops over sequences with host-side lengths: simple and exact, not fast. The GPU kernels implement
the same interface (shard/attention/base.py).
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
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        fp8 = is_fp8_cache(key_cache)
        s = kv_scales or KvScales()
        block_size = key_cache.shape[1]
        num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
        group = num_heads // num_kv_heads
        out = torch.empty_like(query)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            q = query[start : start + q_len]  # [q_len, num_heads, head_dim]
            num_blocks = -(-seq_len // block_size)
            blocks = meta.block_tables[i, :num_blocks].long()
            # [seq_len, num_kv_heads, head_dim]: the sequence's context, gathered from its blocks
            k = key_cache[blocks].flatten(0, 1)[:seq_len]
            v = value_cache[blocks].flatten(0, 1)[:seq_len]
            if fp8:  # stored * per-head scale
                k, v = dequantize_kv(k, s.k_scale, q.dtype), dequantize_kv(v, s.v_scale, q.dtype)
            else:
                k, v = k.to(q.dtype), v.to(q.dtype)
            if group > 1:
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
            allowed = k_pos <= q_pos  # [q_len, seq_len]
            if sliding_window is not None:
                allowed &= q_pos - k_pos < sliding_window
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1),  # [num_heads, q_len, head_dim]
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=allowed,
                scale=scale,
            )
            out[start : start + q_len] = o.transpose(0, 1)
            start += q_len
        return out
