"""Tensor-parallel building blocks; each carries its own weight loader.

Column-parallel: the output features are split over ranks (no communication in forward).
Row-parallel: the input features are split; partial outputs are summed with one all-reduce.
Vocab-parallel embedding / LM head: the vocabulary rows are split; lookups are masked and summed,
logits are gathered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shard.decode_linear import linear, linear_pushed  # F.linear or a faster decode GEMV
from shard.distributed import Dist
from shard.quantization.loading import quantize_loaded_linear
from shard.weights import Weights


class ColumnParallelLinear(nn.Module):
    """y[..., out/world] = x @ W[rank rows].T (+ b[rank rows]).

    part (index, count): hold row block `index` of `count` equal blocks instead of (rank, world),
    e.g. the one KV head a rank reads when KV heads are replicated (shard/models/heads.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dist: Dist,
                 part: tuple[int, int] | None = None):
        super().__init__()
        self.part = part if part is not None else (dist.rank, dist.world_size)
        if out_features % self.part[1]:
            raise ValueError(f"{out_features} output features not divisible by {self.part[1]}")
        self.out_local = out_features // self.part[1]
        self.weight = nn.Parameter(torch.empty(self.out_local, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_local), requires_grad=False) if bias else None
        self.quantized: nn.Module | None = None  # replaces weight/bias under --quantize / fp8

    def load(self, weights: Weights, prefix: str) -> None:
        weights = weights.for_part(*self.part)
        self.weight.data = weights.get_sharded(f"{prefix}.weight", dim=0)
        if self.bias is not None:
            self.bias.data = weights.get_sharded(f"{prefix}.bias", dim=0)
        if weights.quant is not None:
            self.quantized = quantize_loaded_linear(
                weights, prefix, self.weight.data, self.bias, 0, weights.quant
            )
            self.weight = self.bias = None  # free the float copy now, one layer at a time

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(x)
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[..., rank cols] @ W[:, rank cols].T, then + b (added once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dist: Dist):
        super().__init__()
        if in_features % dist.world_size:
            raise ValueError(f"{in_features} input features not divisible by {dist.world_size}")
        self.dist = dist
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features // dist.world_size), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quantized: nn.Module | None = None  # replaces weight under --quantize / fp8

    def load(self, weights: Weights, prefix: str) -> None:
        self.weight.data = weights.get_sharded(f"{prefix}.weight", dim=1)
        if self.bias is not None:
            self.bias.data = weights.get(f"{prefix}.bias")
        if weights.quant is not None:
            # The bias is added once after the all-reduce, so the quantized part has none.
            self.quantized = quantize_loaded_linear(
                weights, prefix, self.weight.data, None, 1, weights.quant
            )
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.quantized(x) if self.quantized is not None else linear(x, self.weight)
        y = self.dist.all_reduce(partial)
        return y if self.bias is None else y + self.bias

    def partial(self, x: torch.Tensor, push: bool = False) -> torch.Tensor | PushedPartial:
        """This rank's share of the output, not yet summed over ranks (the caller sums it, e.g.
        fused with the next norm: `reduce_add_rms_norm`); the bias is counted once, on rank 0.
        push: where the fused all-reduce + norm serves the shape, the GEMV writes the share
        straight into every rank's exchange buffer and a PushedPartial stands for it; the
        caller's next collective must then be its `reduce_add_rms_norm`."""
        fused = self.dist.fused_all_reduce_norm
        if (
            push
            and fused is not None
            and fused.accept_pushes
            and self.quantized is None
            and self.bias is None
            and x.dim() == 2
            and linear_pushed(x, self.weight, fused)
        ):
            return PushedPartial(rows=x.shape[0])
        y = self.quantized(x) if self.quantized is not None else linear(x, self.weight)
        if self.bias is not None and self.dist.rank == 0:
            y = y + self.bias
        return y


@dataclass(frozen=True)
class PushedPartial:
    """A row-parallel output already sitting in every rank's exchange buffer of the fused
    all-reduce + norm (RowParallelLinear.partial with push=True); only reduce_add_rms_norm can
    consume it, and must be the next collective call."""

    rows: int


class VocabSlicedWeight(nn.Module):
    """A [vocab, hidden] weight of which rank r holds rows [r * per_rank, (r + 1) * per_rank),
    zero-padded at the end so that every rank's slice has the same shape."""

    def __init__(self, vocab_size: int, hidden_size: int, dist: Dist):
        super().__init__()
        self.dist = dist
        self.vocab_size = vocab_size
        self.per_rank = math.ceil(vocab_size / dist.world_size)
        self.start = dist.rank * self.per_rank
        self.stop = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)

    def load(self, weights: Weights, prefix: str) -> None:
        rows = weights.get_rows(f"{prefix}.weight", self.start, self.stop)  # [<=per_rank, hidden]
        padded = torch.zeros(self.per_rank, rows.shape[1], dtype=rows.dtype, device=rows.device)
        padded[: rows.shape[0]] = rows
        self.weight.data = padded


class VocabParallelEmbedding(VocabSlicedWeight):
    """Token embedding over vocabulary-sliced rows (summed over ranks)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [n] -> [n, hidden]
        if self.dist.world_size == 1:
            return F.embedding(ids, self.weight)
        return self.dist.all_reduce(self.partial(ids))

    def partial(self, ids: torch.Tensor) -> torch.Tensor:  # ids [n] -> [n, hidden]
        """This rank's share of the lookup, not yet summed over ranks: the rows of ids in this
        rank's vocabulary slice, zeros elsewhere (so the sum over ranks is exact)."""
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0)


class ParallelLMHead(VocabSlicedWeight):
    """Logits over the full vocabulary from vocabulary-sliced weights (gathered over ranks)."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        logits = linear(hidden, self.weight)  # [n, per_rank], model dtype
        # Gathered in the model dtype (half of fp32's bytes), widened after: the same values.
        logits = self.dist.all_gather_last_dim(logits)  # [n, per_rank * world]
        return logits[:, : self.vocab_size].float()


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def load(self, weights: Weights, prefix: str) -> None:
        self.weight.data = weights.get(f"{prefix}.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1:  # one fused kernel instead of 7
            from shard.triton_ops import rms_norm

            return rms_norm(x, self.weight, self.eps)
        # Normalise in fp32 like the reference, then scale in the model dtype.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def add_rms_norm(
    delta: torch.Tensor, x: torch.Tensor, norm: RMSNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + delta), x + delta) for [num_tokens, hidden]: one Triton kernel on CUDA, the
    torch form (same rounding points: the sum rounded to the dtype first) elsewhere."""
    if x.is_cuda:
        from shard.triton_ops import add_rms_norm as fused

        return fused(delta, x, norm.weight, norm.eps)
    residual = x + delta
    return norm(residual), residual


def reduce_add_rms_norm(
    dist: Dist, partial: torch.Tensor | PushedPartial, x: torch.Tensor, norm: RMSNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add after a row-parallel linear: s = x + (sum over ranks of partial), returns
    (norm(s), s). partial [num_tokens, hidden] is RowParallelLinear.partial's output. Decode-sized
    CUDA tensors take one kernel for the all-reduce, the add and the norm where the fused kernel
    is available (shard.all_reduce_norm); otherwise the all-reduce, then add + norm."""
    fused = dist.fused_all_reduce_norm
    if isinstance(partial, PushedPartial):
        assert fused is not None and partial.rows == x.shape[0]
        return fused.reduce_pushed(x, norm.weight, norm.eps)
    if fused is not None and fused.handles(partial):
        return fused(partial, x, norm.weight, norm.eps)
    return add_rms_norm(dist.all_reduce(partial), x, norm)


def load_module_weights(root: nn.Module, weights: Weights) -> None:
    """Calls `load(weights, name)` on every submodule that has one; module names equal the
    checkpoint's tensor prefixes."""
    for name, module in root.named_modules():
        loader = getattr(module, "load", None)
        if callable(loader) and module is not root:
            loader(weights, name)
