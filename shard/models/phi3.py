"""Phi-3 / Phi-3.5 / Phi-4 (dense, model_type phi3): Llama's layers with the checkpoint's fused
`qkv_proj` and `gate_up_proj` read straight into the merged linears (each rank its rows of each
part), LongRoPE ("longrope" / "su": short and long factors, attention factor) in the rotary
layer, and the config's sliding window on every layer. Only assembles layers."""

from __future__ import annotations

from shard.models.base import LoadContext, NotServedNatively
from shard.models.llama import LayerOptions, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Serves model_type phi3."""

    options = LayerOptions(fused_checkpoint=True)

    def __init__(self, ctx: LoadContext):
        cfg = ctx.config
        rope = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if partial != 1.0:  # Phi-4-mini: rotary on part of each head
            raise NotServedNatively(f"partial_rotary_factor {partial} (rotary on part of each "
                                    "head)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise NotServedNatively(f"hidden_act {cfg['hidden_act']!r}")
        super().__init__(ctx)
