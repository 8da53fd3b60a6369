"""A random flat ragged step over a paged KV cache, for attention tests and benchmarks: queries,
K/V caches on shuffled pages and the step's AttentionMetadata."""

from __future__ import annotations

import torch

from shard.attention.base import AttentionMetadata


def random_paged_step(
    query_lens: list[int],  # [num_seqs] new tokens per sequence
    seq_lens: list[int],  # [num_seqs] context incl. the new tokens
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], AttentionMetadata]:
    """(query [num_tokens, num_heads, head_dim], (key_cache, value_cache) each [num_blocks, page,
    num_kv_heads, head_dim], metadata): every sequence on its own randomly chosen pages, so
    that paging is exercised. The slot mapping is zeros (nothing here writes the cache)."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-s // page) for s in seq_lens]
    blocks = sum(widths) + 1
    shape = (blocks, page, num_kv_heads, head_dim)
    cache = (torch.randn(shape, generator=gen).to(device, dtype),
             torch.randn(shape, generator=gen).to(device, dtype))
    perm = torch.randperm(blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(widths), dtype=torch.int32)
    at = 0
    for i, w in enumerate(widths):
        tables[i, :w] = torch.tensor(perm[at : at + w], dtype=torch.int32)
        at += w
    starts = torch.tensor([0] + list(query_lens)).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        starts.to(device), torch.tensor(seq_lens, dtype=torch.int32).to(device),
        tables.to(device), torch.zeros(sum(query_lens), dtype=torch.int64, device=device),
        max(query_lens), max(seq_lens), list(query_lens), list(seq_lens),
    )
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(device, dtype)
    return query, cache, meta
