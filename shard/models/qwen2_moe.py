"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) and a sparse block
per layer: softmax, top-k, renormalized only with norm_topk_prob, plus a shared expert scaled by
sigmoid(shared_expert_gate(x)); layers off decoder_sparse_step or in mlp_only_layers are dense."""

from __future__ import annotations

from torch import nn

from shard.layers.moe import QWEN_EXPERT_NAMES, MoeRouting, SparseMoeBlock
from shard.models.base import LoadContext, NotServedNatively
from shard.models.llama import LlamaMLP
from shard.models.moe import MoeCausalLM, config_num_experts, dense_or_sparse


def _block(ctx: LoadContext, _layer: int) -> nn.Module:
    cfg = ctx.config
    routing = MoeRouting(cfg["num_experts_per_tok"], cfg.get("norm_topk_prob", False))
    return SparseMoeBlock(cfg["hidden_size"], config_num_experts(cfg), cfg["moe_intermediate_size"],
                          routing, ctx.dist, QWEN_EXPERT_NAMES,
                          shared_intermediate=cfg.get("shared_expert_intermediate_size") or 0)


class Qwen2MoeForCausalLM(MoeCausalLM):
    """Serves model_type qwen2_moe."""

    def __init__(self, ctx: LoadContext):
        cfg = ctx.config
        if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            # windows on the layers up to max_window_layers only: per-layer windows
            raise NotServedNatively("qwen2_moe with use_sliding_window (per-layer windows)")
        super().__init__(ctx, dense_or_sparse(_block, lambda c, _i: LlamaMLP(c)))
