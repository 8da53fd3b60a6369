"""RMSNorm of the attention's q and k before rotary, as an option of any attention layer.

Two kinds, by what one norm spans:
- HEAD (Qwen3, Gemma 3): each head's head_dim values on their own, weight [head_dim] shared by the
  heads. Local to a rank under tensor parallelism; one Triton kernel for q and k on CUDA.
- PROJECTION (OLMo-2): the whole projection of a token, all heads' q [heads * head_dim] (k alike),
  weight [heads * head_dim]. Under tensor parallelism a rank holds only its heads' columns, so the
  mean of squares is a sum of per-rank partial sums: one all-reduce of [num_tokens, 2] float32 (q's
  and k's partial sums together) per layer. A KV head replicated over several ranks (fewer KV
  heads than ranks, shard/models/heads.py) is counted once per replica, so its partial sum is
  divided by the replica count first.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from shard.distributed.groups import Dist
from shard.layers.norm import RMSNorm
from shard.layers.weights import WeightLoader, Weights


class QKNormKind(enum.Enum):
    HEAD = "head"  # RMSNorm over each head's head_dim
    PROJECTION = "projection"  # RMSNorm over all heads of the projection (spans ranks)


class HeadRMSNorm(RMSNorm):
    """RMSNorm over the last dim of [num_tokens, heads, head_dim]; weight [head_dim]."""


class ProjectionRMSNorm(nn.Module, WeightLoader):
    """This rank's columns of an RMSNorm over a whole projection of `width` features (all heads).

    part (index, count): this rank holds column block `index` of `count` equal blocks of the
    weight (as its projection holds those rows); replicas: how many ranks hold the same block
    (1 for query heads; world * local_kv_heads / kv_heads for replicated KV heads)."""

    def __init__(self, width: int, eps: float, dist: Dist, part: tuple[int, int], replicas: int):
        super().__init__()
        self.width, self.eps, self.dist = width, eps, dist
        self.part, self.replicas = part, replicas
        self.weight = nn.Parameter(torch.ones(width // part[1]), requires_grad=False)

    def load(self, weights: Weights, prefix: str) -> None:
        self.weight.data = weights.for_part(*self.part).get_sharded(f"{prefix}.weight", dim=0)

    def partial_sum_of_squares(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, local_heads, head_dim] -> [num_tokens] float32: this rank's share of
        the sum of squares over the whole projection."""
        return x.float().pow(2).sum(dim=(-2, -1)) / self.replicas

    def normalize(self, x: torch.Tensor, sum_of_squares: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, local_heads, head_dim] normalized by the all-ranks sum of squares
        [num_tokens]; the weight multiplies in float32, then one rounding (OLMo-2's form)."""
        rstd = torch.rsqrt(sum_of_squares / self.width + self.eps)  # [num_tokens]
        xf = x.float() * rstd[:, None, None]
        w = self.weight.float().view(x.shape[1], x.shape[2])
        return (w * xf).to(x.dtype)


def qk_rms_norm(
    q: torch.Tensor,  # [num_tokens, local_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, local_kv_heads, head_dim]
    q_norm: HeadRMSNorm | ProjectionRMSNorm,
    k_norm: HeadRMSNorm | ProjectionRMSNorm,
) -> tuple[torch.Tensor, torch.Tensor]:  # same shapes
    if isinstance(q_norm, ProjectionRMSNorm) and isinstance(k_norm, ProjectionRMSNorm):
        sums = torch.stack([q_norm.partial_sum_of_squares(q),
                            k_norm.partial_sum_of_squares(k)], dim=-1)  # [num_tokens, 2]
        sums = q_norm.dist.all_reduce(sums)
        return q_norm.normalize(q, sums[:, 0]), k_norm.normalize(k, sums[:, 1])
    assert isinstance(q_norm, HeadRMSNorm) and isinstance(k_norm, HeadRMSNorm)
    if (q.is_cuda and q.stride(-1) == 1 and k.stride(-1) == 1 and q_norm.eps == k_norm.eps
            and q_norm.weight_offset == k_norm.weight_offset):
        from shard.kernels.qk_norm import qk_rms_norm as fused

        return fused(q, k, q_norm.weight, k_norm.weight, q_norm.eps, q_norm.weight_offset)
    return q_norm(q), k_norm(k)
