"""tokenwire's paged attention as a transformers attention implementation.

transformers' attention modules (5.x) project q/k/v, apply their own rotary embedding and norms,
then call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, ...)`.
`paged_attention` is registered there under ATTN_IMPLEMENTATION: it stores the step's new K/V
into the paged cache at the router's slots and attends over each sequence's whole context
through the AttentionBackend, so nothing is recomputed across steps. transformers builds no mask
for an implementation it does not know (masking_utils exits early): causality, sequence
boundaries in the flat batch and sliding windows come from AttentionMetadata.

Each attention module of a served model carries a `PagedLayer` (attribute PAGED_LAYER), set when
the model is built: its layer index into the KV cache and the model's `StepState`, which the
model's forward fills before calling transformers' forward (the step's metadata and cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shard.attention.base import AttentionBackend, AttentionMetadata

ATTN_IMPLEMENTATION = "tokenwire_paged"
PAGED_LAYER = "tokenwire_paged_layer"


@dataclass
class StepState:
    """What every layer's attention reads during one forward (set per step by the model)."""

    meta: AttentionMetadata | None = None
    # Per layer (key_cache, value_cache), each [num_blocks, block_size, kv_heads, head_dim].
    kv_cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None


@dataclass
class PagedLayer:
    """One attention module's place in the paged cache."""

    index: int  # its (key, value) pools in StepState.kv_cache
    backend: AttentionBackend
    step: StepState


def register() -> None:
    """Registers paged_attention with transformers (idempotent; called when a model is built,
    never at import time)."""
    import transformers

    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


def paged_attention(
    module: nn.Module,
    query: torch.Tensor,  # [1, num_heads, num_tokens, head_dim], rotated
    key: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim], rotated
    value: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    attention_mask: torch.Tensor | None,  # always None for this implementation
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:  # ([1, num_tokens, num_heads, head_dim], no weights)
    layer: PagedLayer = getattr(module, PAGED_LAYER)
    meta, caches = layer.step.meta, layer.step.kv_cache
    if meta is None or caches is None:
        raise RuntimeError("paged attention called outside a tokenwire step")
    key_cache, value_cache = caches[layer.index]
    q = query[0].transpose(0, 1)  # [num_tokens, num_heads, head_dim]
    # [num_tokens, num_kv_heads, head_dim], contiguous as the cache-store kernels expect
    k = key[0].transpose(0, 1).to(key_cache.dtype).contiguous()
    v = value[0].transpose(0, 1).to(value_cache.dtype).contiguous()
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    b = layer.backend
    b.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
    # Gemma 2's attention-logit soft-capping is the backend's option (its kernels cap on device).
    o = b.attend(q.contiguous(), key_cache, value_cache, meta, scale, sliding_window,
                 softcap=softcap or None)
    return o.unsqueeze(0), None

