"""OLMo-2: Llama's attention and MLP with norms after them instead of before (the output of each
normed, then added to the residual stream) and q/k RMSNorms over the whole projection (all
heads' q, all heads' k; under tensor parallelism the mean of squares spans the ranks:
shard/layers/qk_norm.py). Only assembles layers."""

from __future__ import annotations

import torch
from torch import nn

from shard.attention.base import AttentionMetadata
from shard.layers.norm import RMSNorm
from shard.layers.qk_norm import QKNormKind
from shard.layers.rotary import RotaryEmbedding
from shard.models.base import LoadContext
from shard.models.llama import LayerOptions, LlamaAttention, LlamaForCausalLM, LlamaMLP


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, ctx: LoadContext, rotary: RotaryEmbedding, sliding_window: int | None,
                 opts: LayerOptions):
        super().__init__()
        eps, hidden = ctx.config.get("rms_norm_eps", 1e-6), ctx.config["hidden_size"]
        self.self_attn = LlamaAttention(ctx, rotary, sliding_window, opts)
        self.mlp = LlamaMLP(ctx, opts)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden] residual stream
        positions: torch.Tensor,  # [num_tokens]
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        # Each norm needs its linear's all-reduced output (the norm comes before the add), so
        # the pre-norm layers' fused reduce + add + norm does not apply.
        x = x + self.post_attention_layernorm(self.self_attn(x, positions, cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(LlamaForCausalLM):
    """Serves model_type olmo2."""

    options = LayerOptions(qk_norm=QKNormKind.PROJECTION)
    decoder_layer = Olmo2DecoderLayer
    fuses_residuals = False
