"""The attention interface every backend implements.

A step is one flat ragged batch: the new tokens of all sequences concatenated (prefill chunks and
single decode tokens alike). Each sequence's keys/values live in the paged KV cache, one pool of
fixed-size blocks per layer; the router's block ids decide where (slot = block * block_size +
position % block_size).

KV cache layout per layer: key_cache and value_cache, each [num_blocks, block_size, num_kv_heads,
head_dim]. A backend that needs another layout converts inside itself or says so in Info.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from shard.quantization.kv_cache import KvScales


@dataclass
class AttentionMetadata:
    """Where each sequence's new tokens sit in the flat batch and where its context lives.

    num_seqs sequences, num_tokens new tokens in all. Sequence i's new tokens are
    query[query_start_loc[i]:query_start_loc[i + 1]] at positions
    seq_lens[i] - query_len_i .. seq_lens[i] - 1 of that sequence.
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32, context length incl. the new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token
    max_query_len: int
    max_seq_len: int
    # Host copies, so that portable code can loop without device syncs.
    query_lens_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    """Stores new K/V into the paged cache and computes causal attention over each sequence's
    whole context (cached tokens + new tokens)."""

    name: str

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        kv_scales: KvScales | None = None,  # fp8 caches: stored = x / scale (per KV head)
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,  # attend to at most this many most recent positions
        kv_scales: KvScales | None = None,  # fp8 caches: read value = stored * scale
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
