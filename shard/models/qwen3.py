"""Qwen3 (dense): Llama's layers with per-head RMSNorm of q and k before rotary, head_dim that
need not equal hidden_size / num_attention_heads, tied embeddings on the small sizes (all handled
by LlamaForCausalLM's loading). Only assembles layers."""

from __future__ import annotations

from shard.layers.qk_norm import QKNormKind
from shard.models.base import LoadContext, NotServedNatively
from shard.models.llama import LayerOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Serves model_type qwen3."""

    options = LayerOptions(qk_norm=QKNormKind.HEAD)

    def __init__(self, ctx: LoadContext):
        cfg = ctx.config
        # use_sliding_window puts a window on the layers from max_window_layers on only: per-layer
        # windows, which the native path does not assemble (no released Qwen3 checkpoint sets it).
        if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            raise NotServedNatively("qwen3 with use_sliding_window (per-layer windows from "
                                    "max_window_layers on)")
        super().__init__(ctx)
