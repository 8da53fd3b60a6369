"""Vocabulary-parallel embedding and LM head: the vocabulary rows are split over ranks; lookups
are masked and summed, logits are gathered."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shard.distributed.groups import Dist
from shard.layers.decode_linear import linear
from shard.layers.weights import WeightLoader, Weights


class VocabSlicedWeight(nn.Module, WeightLoader):
    """A [vocab, hidden] weight of which rank r holds rows [r * per_rank, (r + 1) * per_rank),
    zero-padded at the end so that every rank's slice has the same shape. Where the checkpoint
    stores the table in an integer form (a GGUF snapshot's packed token embedding, a
    compressed-tensors pack-quantized lm_head), it stays so: `quantized` (an IntLinear of this
    rank's rows, shard/quantization/embedding.py) replaces `weight` (then None)."""

    def __init__(self, vocab_size: int, hidden_size: int, dist: Dist):
        super().__init__()
        self.dist = dist
        self.vocab_size = vocab_size
        self.per_rank = math.ceil(vocab_size / dist.world_size)
        self.start = dist.rank * self.per_rank
        self.stop = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)
        self.quantized: nn.Module | None = None
        self.rows_dtype = torch.get_default_dtype()  # a quantized table's lookups: model dtype

    def load(self, weights: Weights, prefix: str) -> None:
        from shard.quantization.embedding import load_int_rows, stored_int_rows

        if stored_int_rows(weights, prefix):
            self.quantized = load_int_rows(weights, prefix, self.start, self.stop, self.per_rank)
            self.rows_dtype = weights.dtype
            self.weight = None
            return
        rows = weights.get_rows(f"{prefix}.weight", self.start, self.stop)  # [<=per_rank, hidden]
        padded = torch.zeros(self.per_rank, rows.shape[1], dtype=rows.dtype, device=rows.device)
        padded[: rows.shape[0]] = rows
        self.weight.data = padded


class VocabParallelEmbedding(VocabSlicedWeight):
    """Token embedding over vocabulary-sliced rows (summed over ranks). scale (Gemma:
    sqrt(hidden)): the rows are multiplied by it, the factor first rounded to the model dtype
    and the product taken in the model dtype, as transformers' scaled word embeddings do."""

    def __init__(self, vocab_size: int, hidden_size: int, dist: Dist, scale: float | None = None):
        super().__init__(vocab_size, hidden_size, dist)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [n] -> [n, hidden]
        if self.dist.world_size == 1:
            return self._scaled(self._rows(ids))
        return self.dist.all_reduce(self.partial(ids))

    def _rows(self, local: torch.Tensor) -> torch.Tensor:  # local row ids [n] -> [n, hidden]
        if self.quantized is None:
            return F.embedding(local, self.weight)
        from shard.quantization.embedding import lookup_rows

        return lookup_rows(self.quantized, local, self.rows_dtype)

    def _scaled(self, rows: torch.Tensor) -> torch.Tensor:  # [n, hidden]
        if self.scale is None:
            return rows
        # The factor rounded to the model dtype on the host (a device tensor made here would be
        # a copy inside CUDA-graph capture); a 16-bit tensor times a Python float computes in
        # fp32 and rounds once, as the product with a 0-dim tensor of the dtype does.
        return rows * torch.tensor(self.scale, dtype=rows.dtype).item()

    def partial(self, ids: torch.Tensor) -> torch.Tensor:  # ids [n] -> [n, hidden]
        """This rank's share of the lookup, not yet summed over ranks: the rows of ids in this
        rank's vocabulary slice, zeros elsewhere (so the sum over ranks is exact)."""
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = self._rows(local.masked_fill(outside, 0))
        # Scaled before the sum: every row is non-zero on one rank only, so the sum is exact.
        return self._scaled(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabSlicedWeight):
    """Logits over the full vocabulary from vocabulary-sliced weights (gathered over ranks).
    softcap (Gemma's final_logit_softcapping): logits -> softcap * tanh(logits / softcap), in
    float32."""

    def __init__(self, vocab_size: int, hidden_size: int, dist: Dist,
                 softcap: float | None = None):
        super().__init__(vocab_size, hidden_size, dist)
        self.softcap = softcap

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.quantized = embedding.quantized  # the same IntLinear: one copy of the table

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        if self.quantized is not None:
            logits = self.quantized(hidden)  # [n, per_rank] in hidden's dtype
        else:
            logits = linear(hidden, self.weight)  # [n, per_rank], model dtype
        # Gathered in the model dtype (half of fp32's bytes), widened after: the same values.
        logits = self.dist.all_gather_last_dim(logits)  # [n, per_rank * world]
        logits = logits[:, : self.vocab_size].float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
