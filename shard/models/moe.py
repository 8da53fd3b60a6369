"""What the mixture-of-experts families share: the Llama-shaped decoder with a sparse block as
its MLP, and the routing statistics of all its MoE layers (shard/layers/moe.py's RoutingStats).
Each family's file (mixtral.py, qwen2_moe.py, qwen3_moe.py) only says how its block is built."""

from __future__ import annotations

import torch
from torch import nn

from shard.attention.base import AttentionMetadata
from shard.layers.moe import FusedMoE, RoutingStats
from shard.models.base import LoadContext
from shard.models.llama import LlamaForCausalLM, MlpFactory
from shard.models.paged_kv import KVCache


class MoeCausalLM(LlamaForCausalLM):
    """A Llama-shaped model whose layers' MLPs come from `mlp` (sparse blocks, or dense MLPs on
    the layers a config keeps dense)."""

    supports_lora = False  # adapters on stacked experts are not implemented

    supports_images = False  # text only (VLMs: the transformers backend)

    def __init__(self, ctx: LoadContext, mlp: MlpFactory, mlp_name: str = "mlp"):
        super().__init__(ctx, mlp, mlp_name)
        experts = [m for m in self.modules() if isinstance(m, FusedMoE)]
        self.num_experts = experts[0].num_experts if experts else 0
        self.routing_stats = RoutingStats(len(experts), self.num_experts, ctx.device)
        for i, m in enumerate(experts):
            m.attach_stats(self.routing_stats, i)

    def take_expert_load(self) -> list[int]:
        """take_expert_counts on the host (one small device-to-host copy)."""
        return self.take_expert_counts().tolist()

    def take_expert_counts(self) -> torch.Tensor:
        """[num_experts] int64 on the device: routed (token, layer) pairs per expert since the
        last call, all MoE layers summed; the counters restart from zero (no host sync)."""
        return self.routing_stats.take_device()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        # Real rows only in the routing counts: CUDA-graph padding rows have slot -1.
        self.routing_stats.begin_step(meta.slot_mapping >= 0)
        return super().forward(input_ids, positions, kv_cache, meta, logits_indices)


def config_num_experts(cfg: dict) -> int:
    """Routed experts per layer: Qwen's config.json says num_experts; transformers 5 writes
    num_local_experts for some families (its attribute map)."""
    return cfg.get("num_experts") or cfg["num_local_experts"]


def dense_or_sparse(sparse: MlpFactory, dense: MlpFactory) -> MlpFactory:
    """Qwen's layer choice: sparse unless listed in mlp_only_layers or off decoder_sparse_step."""

    def build(ctx: LoadContext, i: int) -> nn.Module:
        cfg = ctx.config
        step = cfg.get("decoder_sparse_step", 1) or 1
        if i not in (cfg.get("mlp_only_layers") or []) and (i + 1) % step == 0:
            return sparse(ctx, i)
        return dense(ctx, i)

    return build
