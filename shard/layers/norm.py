"""RMSNorm, and the residual add after a row-parallel linear fused with the next norm (and, under
tensor parallelism, with the all-reduce before it)."""

from __future__ import annotations

import torch
from torch import nn

from shard.distributed.groups import Dist
from shard.layers.linear import PushedPartial
from shard.layers.weights import WeightLoader, Weights


class RMSNorm(nn.Module, WeightLoader):
    """RMSNorm over the last dim. weight_offset 0 (Llama): weight * normalized.to(dtype).
    weight_offset 1.0 (Gemma, whose checkpoints store w with the norm scaling by 1 + w):
    (normalized * (1 + w)) in float32, rounded to the dtype once, as transformers' GemmaRMSNorm."""

    def __init__(self, hidden_size: int, eps: float, weight_offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def load(self, weights: Weights, prefix: str) -> None:
        self.weight.data = weights.get(f"{prefix}.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1:  # one fused kernel instead of 7
            from shard.kernels.elementwise import rms_norm

            return rms_norm(x, self.weight, self.eps, self.weight_offset)
        # Normalise in fp32 like the reference, then scale in the model dtype (Llama) or in
        # fp32 before the one rounding (Gemma's offset weight).
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            return (xf * (self.weight_offset + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)


def add_rms_norm(
    delta: torch.Tensor, x: torch.Tensor, norm: RMSNorm, delta_norm: RMSNorm | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + delta), x + delta) for [num_tokens, hidden], delta already reduced over ranks;
    with delta_norm (sandwich norms: a sub-block's output normalized before the residual add)
    delta_norm(delta) in delta's place. One Triton kernel on CUDA, the torch form (same rounding
    points: the normalized delta, then the sum, rounded to the dtype first) elsewhere."""
    if x.is_cuda and (delta_norm is None or delta_norm.weight_offset == norm.weight_offset):
        from shard.kernels.elementwise import add_rms_norm as fused

        return fused(delta, x, norm.weight, norm.eps, norm.weight_offset,
                     None if delta_norm is None else delta_norm.weight,
                     0.0 if delta_norm is None else delta_norm.eps)
    if delta_norm is not None:
        delta = delta_norm(delta)
    residual = x + delta
    return norm(residual), residual


def reduce_add_rms_norm(
    dist: Dist, partial: torch.Tensor | PushedPartial, x: torch.Tensor, norm: RMSNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add after a row-parallel linear: s = x + (sum over ranks of partial), returns
    (norm(s), s). partial [num_tokens, hidden] is RowParallelLinear.partial's output. Decode-sized
    CUDA tensors take one kernel for the all-reduce, the add and the norm where the fused kernel
    is available (shard.distributed.all_reduce_norm); otherwise the all-reduce, then add + norm."""
    fused = dist.fused_all_reduce_norm
    if norm.weight_offset:  # the fused collective computes Llama's norm only (no offset)
        assert isinstance(partial, torch.Tensor)
        return add_rms_norm(dist.all_reduce(partial), x, norm)
    if isinstance(partial, PushedPartial):
        assert fused is not None and partial.rows == x.shape[0]
        return fused.reduce_pushed(x, norm.weight, norm.eps)
    if fused is not None and fused.handles(partial):
        return fused(partial, x, norm.weight, norm.eps)
    return add_rms_norm(dist.all_reduce(partial), x, norm)
