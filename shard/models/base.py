"""What every model implementation offers the runner."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from shard.attention.base import AttentionBackend, AttentionMetadata
from shard.distributed.groups import Dist
from shard.quantization.kv_cache import KvScales
from shard.quantization.methods import KvCacheDtype, KvCacheRotation, QuantizeMethod


class NotServedNatively(ValueError):
    """A native model class cannot serve this config (a variant of the family it does not
    assemble); --model-impl auto then serves it through the transformers backend (as it does
    on a NotImplementedError from the native layers: an unsupported rope_type, say)."""


@dataclass(frozen=True)
class LoadContext:
    """Everything a model class needs to build itself and read its weights."""

    model_dir: Path
    config: dict  # config.json
    device: torch.device
    dtype: torch.dtype
    dist: Dist
    attention: AttentionBackend
    quantize: QuantizeMethod | None = None  # --quantize (fp8 checkpoints are detected anyway)
    kv_cache_dtype: KvCacheDtype = KvCacheDtype.AUTO  # --kv-cache-dtype
    kv_cache_rotation: KvCacheRotation = KvCacheRotation.HADAMARD  # --kv-cache-rotation (fp8 only)


@dataclass(frozen=True)
class ImageEmbeds:
    """Image embeddings of one step, put in place of the token embeddings at their rows."""

    rows: torch.Tensor  # [n] int64, rows of the flat batch (placeholder positions)
    embeds: torch.Tensor  # [n, hidden] in the model dtype


class CausalLM(Protocol):
    """A paged-KV causal language model of one tensor-parallel rank."""

    vocab_size: int
    max_position_embeddings: int
    sliding_window: int | None
    attention_name: str  # what Info reports: the attention backend's name
    # Which code serves it (Info and the start-up log): "native" (shard/models/<family>.py) or
    # "transformers" (the transformers backend, shard/models/transformers_backend.py).
    model_impl: str
    # Its projections are tokenwire's tensor-parallel linears, which apply LoRA adapters
    # (shard/lora attaches them by checkpoint name).
    supports_lora: bool
    # Decode steps may be captured in CUDA graphs (declared from the model and its
    # quantization, never probed): no host syncs, no host-side lengths. The runner captures
    # only where this and the attention backend's graph_safe both hold.
    cuda_graph_safe: bool
    # A vision-language model (VisionLM below): prefill steps may carry image embeddings.
    supports_images: bool

    def begin_kv_calibration(self) -> bool:
        """fp8 KV caches: start recording max |K|, |V| per layer and KV head (warmup's worst-case
        prefill runs next); False (nothing to calibrate) for model-dtype caches."""
        ...

    def finish_kv_calibration(self, headroom: float | None = None) -> list[KvScales]:
        """Sets every layer's fp8 cache scales from what was observed (in place: captured
        graphs keep their addresses); returns them."""
        ...

    def take_expert_counts(self) -> torch.Tensor | None:
        """Mixture-of-experts models: routed (token, layer) pairs per expert since the last
        call, all MoE layers summed, as a device tensor [num_experts] int64 (the counters are
        cleared; no host sync); None for dense models."""
        ...

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one KV block takes on this rank, all layers together."""
        ...

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> Any:
        """The KV cache object passed back to forward (per layer key/value pools)."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64, the step's new tokens
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: Any,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits] int64, rows of the flat batch to project
    ) -> torch.Tensor:  # [num_logits, vocab_size] float32
        ...


class VisionLM(CausalLM, Protocol):
    """A CausalLM with a vision encoder (supports_images): `forward` also takes
    `image_embeds=ImageEmbeds` on prefill steps whose chunks hold image placeholders. An M-RoPE
    model (mrope: Qwen2-VL) also takes `positions` [3, num_tokens] on steps with prompt rows of
    a request with images (the engine gets them from rope_positions when the request arrives);
    its other rows sit at index + delta, as [num_tokens]."""

    mrope: bool

    def rope_positions(
        self, token_ids: list[int], images: list[tuple[int, int, tuple[int, ...]]]
    ) -> tuple[Any, int]:  # ([3, len(token_ids)] int64 numpy array, delta)
        """M-RoPE models: the prompt's positions and the delta of the positions after it;
        images: (offset, length, shape) of each image in prompt order."""
        ...

    def encode_images(
        self, pixel_values: list[torch.Tensor]  # each [3, H, W] or [t, h, w, patch_dim] float32
    ) -> list[torch.Tensor]:  # each [num_tokens, hidden] on the device, in the model dtype
        """The vision encoder and projector: each image's placeholder embeddings."""
        ...

    def image_token_count(self, shape: tuple[int, ...]) -> int | None:
        """Embedding rows encode_images yields for pixel values of this shape; None when the
        shape is not one the encoder takes (checked before a step runs: a wrong count from
        the router is a refused request, never a failed step)."""
        ...
