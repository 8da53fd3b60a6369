"""Mixtral: Mistral's attention and a sparse MoE block per layer, `block_sparse_moe` (router
`gate`, experts w1/w3/w2); softmax over all experts, top-k, renormalized."""

from __future__ import annotations

from torch import nn

from shard.layers.moe import MIXTRAL_EXPERT_NAMES, MoeRouting, SparseMoeBlock
from shard.models.base import LoadContext
from shard.models.moe import MoeCausalLM


def _block(ctx: LoadContext, _layer: int) -> nn.Module:
    cfg = ctx.config
    routing = MoeRouting(top_k=cfg["num_experts_per_tok"], renormalize=True)
    return SparseMoeBlock(cfg["hidden_size"], cfg["num_local_experts"], cfg["intermediate_size"],
                          routing, ctx.dist, MIXTRAL_EXPERT_NAMES)


class MixtralForCausalLM(MoeCausalLM):
    """Serves model_type mixtral."""

    def __init__(self, ctx: LoadContext):
        super().__init__(ctx, _block, mlp_name="block_sparse_moe")
