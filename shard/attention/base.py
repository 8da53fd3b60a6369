"""The attention interface every backend implements.

A step is one flat ragged batch: the new tokens of all sequences concatenated (prefill chunks and
single decode tokens alike). Each sequence's keys/values live in the paged KV cache, one pool of
fixed-size blocks per layer; the router's block ids decide where (slot = block * block_size +
position % block_size).

KV cache layout per layer: key_cache and value_cache, each [num_blocks, block_size, num_kv_heads,
head_dim]. A backend that needs another layout converts inside itself or says so in Info.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from shard.kernels.head_norms import HeadNorms
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
    # What a backend derives from the host lists once per step and every layer reuses (e.g.
    # shard/attention/mixed_step.py's split and tile map, already on the device).
    derived: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class Rotary(Protocol):
    """The rotary embedding a backend applies (shard/layers/rotary.py's RotaryEmbedding)."""

    cos: torch.Tensor  # [max_positions, head_dim] float32
    sin: torch.Tensor  # [max_positions, head_dim] float32

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotated q, rotated k); positions [num_tokens], q/k [num_tokens, heads, head_dim]."""
        ...


class AttentionBackend(Protocol):
    """Stores new K/V into the paged cache and computes causal attention over each sequence's
    whole context (cached tokens + new tokens).

    Capabilities a backend declares (read by the runner and the attention layer):
    - graph_safe: decode steps read only device tensors and launch a grid that depends on the
      batch size alone, so they can be captured in CUDA graphs (shard/runner/cuda_graphs.py);
    - fuse_rotary_into_decode: decode-only steps should take rotate_write_and_attend_decode
      (one kernel) rather than rotate_and_write_kv + attend; benchmarks switch it off to compare.
    - fuses_qk_norm_into_decode: rotate_write_and_attend_decode also applies per-head q/k
      RMSNorms (head_norms) before the rotation, saving their own launch (Qwen3, Gemma 3).
    - short_decode_context(num_seqs): a decode-only step whose contexts all fit this many
      positions (meta.max_seq_len) takes a launch made for short contexts; the graph runner then
      captures a second graph per such batch size, with max_seq_len at this bound (0: none).
    Backends subclass this protocol: the fused methods' default bodies compose the plain ones,
    and a backend with a kernel for them overrides them, with the same results.
    """

    name: str
    graph_safe: bool
    fuse_rotary_into_decode: bool
    fuses_qk_norm_into_decode: bool

    def short_decode_context(self, num_seqs: int) -> int:
        """Positions up to which a decode-only step of num_seqs sequences takes its short-context
        launch (see the capabilities above); 0: no such launch."""
        return 0

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
        softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
        # A hint: the weights the next launch streams (o_proj's), which a decode kernel may
        # warm into L2 while it runs (shard/kernels/l2_warm.py); backends may ignore it.
        warm: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...

    def mixed_warmup_decode_rows(self) -> list[int]:
        """Decode-row counts of the mixed steps (one prompt chunk plus that many one-token
        rows) that warmup runs so that every kernel variant a mixed step can pick is compiled
        before traffic; [] (the default): the backend compiles nothing per step shape."""
        return []

    # The fused steps below default to composing write_kv and attend (what a backend without a
    # kernel for them does); backends with one override them, with the same results. Shapes:
    # positions [n] int64; query [n, num_heads, head_dim] and key / value [n, num_kv_heads,
    # head_dim], not yet rotated; caches [num_blocks, block_size, num_kv_heads, head_dim].
    def rotate_and_write_kv(
        self, rotary: Rotary, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
        value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, kv_scales: KvScales | None = None,
    ) -> torch.Tensor:
        """rotary(q, k), then write_kv(k, v) at slot_mapping [n]; returns the rotated query."""
        query, key = rotary(positions, query, key)
        self.write_kv(key, value, key_cache, value_cache, slot_mapping, kv_scales)
        return query

    def rotate_write_and_attend_decode(
        self, rotary: Rotary, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
        value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float, sliding_window: int | None,
        kv_scales: KvScales | None = None, softcap: float | None = None,
        warm: torch.Tensor | None = None,  # as attend's
        head_norms: HeadNorms | None = None,  # only where fuses_qk_norm_into_decode
    ) -> torch.Tensor:
        """rotate_and_write_kv, then attend, for a decode-only step (one new token per
        sequence: the caller checks meta.is_decode_only); returns [n, num_heads, head_dim]."""
        assert head_norms is None, f"{self.name}: no q/k norm inside the decode kernel"
        query = self.rotate_and_write_kv(
            rotary, positions, query, key, value, key_cache, value_cache, meta.slot_mapping,
            kv_scales,
        )
        return self.attend(query, key_cache, value_cache, meta, scale, sliding_window, kv_scales,
                           softcap, warm)
