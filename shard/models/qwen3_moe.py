"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm, no
biases) and a sparse block per layer: softmax, top-k, renormalized with norm_topk_prob, no shared
expert; layers in mlp_only_layers or off decoder_sparse_step are dense."""

from __future__ import annotations

from torch import nn

from shard.layers.moe import QWEN_EXPERT_NAMES, MoeRouting, SparseMoeBlock
from shard.layers.qk_norm import QKNormKind
from shard.models.base import LoadContext, NotServedNatively
from shard.models.llama import LayerOptions, LlamaMLP
from shard.models.moe import MoeCausalLM, config_num_experts, dense_or_sparse


def _block(ctx: LoadContext, _layer: int) -> nn.Module:
    cfg = ctx.config
    routing = MoeRouting(cfg["num_experts_per_tok"], cfg.get("norm_topk_prob", False))
    return SparseMoeBlock(cfg["hidden_size"], config_num_experts(cfg), cfg["moe_intermediate_size"],
                          routing, ctx.dist, QWEN_EXPERT_NAMES)


class Qwen3MoeForCausalLM(MoeCausalLM):
    """Serves model_type qwen3_moe."""

    options = LayerOptions(qk_norm=QKNormKind.HEAD)

    def __init__(self, ctx: LoadContext):
        cfg = ctx.config
        if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            raise NotServedNatively("qwen3_moe with use_sliding_window (per-layer windows)")
        super().__init__(ctx, dense_or_sparse(_block, lambda c, _i: LlamaMLP(c)))
