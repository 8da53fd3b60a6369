"""Tensor-parallel linear layers; each carries its own weight loader.

Column-parallel: the output features are split over ranks (no communication in forward).
Row-parallel: the input features are split; partial outputs are summed with one all-reduce (or
left to the caller, fused with the next norm: layers/norm.py's reduce_add_rms_norm).
Merged column-parallel: several column-parallel linears over the same input (q/k/v, gate/up) as
one layer; on CUDA their weights become row blocks of one merged weight, so that a decode step
runs one GEMV (or one fp8 GEMV with the SiLU-and-mul in its epilogue) instead of two or three.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shard.distributed.groups import Dist
from shard.kernels.setting import Setting
from shard.layers import decode_linear
from shard.layers.decode_linear import linear, linear_pushed  # F.linear or a faster decode GEMV
from shard.layers.lora import LoraWeights
from shard.layers.weights import WeightLoader, Weights
from shard.quantization.fp8 import Fp8Linear
from shard.quantization.int_weights import IntLinear
from shard.quantization.loading import load_int_linear, quantize_loaded_linear
from shard.quantization.w8a8 import W8A8Linear

# Opt-in: MergedColumnParallelLinear.forward_add_rms_norm computes the residual add and the
# RMSNorm before it in the GEMV's own launch (shard/kernels/norm_gemv.py) for steps of a few
# tokens; off until measured to beat the tuned GEMV plus the norm launch
# (benchmarks/moe_b1_bench.py compares both in one process).
_NORM_PROLOGUE = Setting(False)


def norm_prologue(on: bool) -> AbstractContextManager[None]:
    """Inside the block forward_add_rms_norm serves (on) or declines (off). Capture a CUDA graph
    under the setting it is replayed with."""
    return _NORM_PROLOGUE.override(on)


def _packed_int(weights: Weights, prefix: str) -> bool:
    """Whether this linear is stored packed by a GPTQ / AWQ checkpoint (layers the checkpoint
    left unquantized, e.g. an ignored lm_head, keep their `.weight`)."""
    packed = weights.quant.packed if weights.quant is not None else None
    return packed is not None and weights.has(f"{prefix}.{packed.layout.tensor_names[0]}")


class ColumnParallelLinear(nn.Module, WeightLoader):
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
        self.in_features = in_features
        self.weight = nn.Parameter(torch.empty(self.out_local, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_local), requires_grad=False) if bias else None
        self.quantized: nn.Module | None = None  # replaces weight/bias under --quantize / fp8

    def load(self, weights: Weights, prefix: str) -> None:
        weights = weights.for_part(*self.part)
        if self.bias is not None:
            self.bias.data = weights.get_sharded(f"{prefix}.bias", dim=0)
        if _packed_int(weights, prefix):  # GPTQ / AWQ: no `.weight`, packed tensors instead
            self.quantized = load_int_linear(weights, prefix, self.bias, 0, weights.quant.packed)
            self.weight = self.bias = None
            return
        self.weight.data = weights.get_sharded(f"{prefix}.weight", dim=0)
        self._quantize(weights, prefix)

    def load_rows_of(self, weights: Weights, fused: str, offset: int) -> None:
        """Reads this part from a checkpoint tensor that stores several parts one after another
        along its rows (`{fused}.weight`, e.g. Phi-3's qkv_proj): the part starts at row
        `offset` of it, and this rank reads its block of the part's rows."""
        if (weights.has(f"{fused}.weight_scale") or weights.has(f"{fused}.weight_scale_inv")
                or _packed_int(weights, fused)):
            raise NotImplementedError(
                f"{fused}: quantized checkpoint tensors on a fused projection are not supported "
                "by the native model code"
            )
        start = offset + self.part[0] * self.out_local
        stop = start + self.out_local
        self.weight.data = weights.get_rows(f"{fused}.weight", start, stop)
        if self.bias is not None:
            self.bias.data = weights.get_rows(f"{fused}.bias", start, stop)
        self._quantize(weights, fused)

    def _quantize(self, weights: Weights, prefix: str) -> None:
        if weights.quant is not None:
            self.quantized = quantize_loaded_linear(
                weights, prefix, self.weight.data, self.bias, 0, weights.quant
            )
            self.weight = self.bias = None  # free the float copy now, one layer at a time

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(x)
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module, WeightLoader):
    """y = sum over ranks of x[..., rank cols] @ W[:, rank cols].T, then + b (added once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dist: Dist):
        super().__init__()
        if in_features % dist.world_size:
            raise ValueError(f"{in_features} input features not divisible by {dist.world_size}")
        self.dist = dist
        self.in_features, self.out_features = in_features, out_features  # full, all ranks
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features // dist.world_size), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quantized: nn.Module | None = None  # replaces weight under --quantize / fp8
        # Resident LoRA adapters (shard/lora attaches them when --max-loras > 0).
        self.lora: LoraWeights | None = None
        # [out + E, in_local] with LoRA on a plain weight: the weight (rows [:out], which
        # self.weight views) and every slot's A (LoraWeights.fold_into); one GEMM gives both.
        self.lora_weight: torch.Tensor | None = None

    def attach_lora(self, lora: LoraWeights) -> None:
        """Adapters on this linear; folded into the weight where it is a plain one. Under
        tensor parallelism each rank's x @ A_rank^T is a partial h: its expand adds a partial
        delta to the rank's partial output, and the all-reduce sums both (linear in h)."""
        self.lora = lora
        if self.quantized is None and self.weight is not None:
            wide = lora.fold_into(self.weight.data)
            if wide is not None:
                self.weight.data = wide[: self.weight.shape[0]]
                self.lora_weight = wide

    def _lora_partial(self, x: torch.Tensor, lora: LoraWeights) -> torch.Tensor:
        """This rank's share of the output with each row's adapter (bias not added)."""
        if self.lora_weight is not None:
            return lora.expand_folded(linear(x, self.lora_weight))
        y = self.quantized(x) if self.quantized is not None else linear(x, self.weight)
        lora.apply_(x, y)
        return y

    def load(self, weights: Weights, prefix: str) -> None:
        if self.bias is not None:
            self.bias.data = weights.get(f"{prefix}.bias")
        if _packed_int(weights, prefix):  # GPTQ / AWQ; the bias is added after the all-reduce
            self.quantized = load_int_linear(weights, prefix, None, 1, weights.quant.packed)
            self.weight = None
            return
        self.weight.data = weights.get_sharded(f"{prefix}.weight", dim=1)
        if weights.quant is not None:
            # The bias is added once after the all-reduce, so the quantized part has none.
            self.quantized = quantize_loaded_linear(
                weights, prefix, self.weight.data, None, 1, weights.quant
            )
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None and self.lora.batch.active:
            partial = self._lora_partial(x, self.lora)  # summed by the all-reduce below
        else:
            partial = self.quantized(x) if self.quantized is not None else linear(x, self.weight)
        y = self.dist.all_reduce(partial)
        return y if self.bias is None else y + self.bias

    def streamed_weight(self) -> torch.Tensor | None:
        """The tensor a decode-sized forward streams (16-bit, or fp8's e4m3 weight), for a
        launch before it to warm into L2; None for other layouts (GPTQ / AWQ packs)."""
        if self.quantized is None:
            return self.weight
        weight = getattr(self.quantized, "weight", None)
        return weight if isinstance(weight, torch.Tensor) else None

    def partial(self, x: torch.Tensor, push: bool = False) -> torch.Tensor | PushedPartial:
        """This rank's share of the output, not yet summed over ranks (the caller sums it, e.g.
        fused with the next norm: `reduce_add_rms_norm`); the bias is counted once, on rank 0.
        push: where the fused all-reduce + norm serves the shape, the GEMV writes the share
        straight into every rank's exchange buffer and a PushedPartial stands for it; the
        caller's next collective must then be its `reduce_add_rms_norm`."""
        fused = self.dist.fused_all_reduce_norm
        lora = self.lora if self.lora is not None and self.lora.batch.active else None
        if (
            push
            and lora is None
            and fused is not None
            and fused.accept_pushes
            and self.quantized is None
            and self.bias is None
            and x.dim() == 2
            and linear_pushed(x, self.weight, fused)
        ):
            return PushedPartial(rows=x.shape[0])
        if lora is not None:
            y = self._lora_partial(x, lora)
        else:
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


class _MergedWeight:
    """The merged [sum(out), in] weight that the parts' weights are row blocks (views) of, with
    its two decode entry points. Not an nn.Module: the parts stay the modules (checkpoint names,
    loaders, quantization)."""

    def __init__(
        self,
        linear: Callable[[torch.Tensor], torch.Tensor],  # [n, in] -> [n, sum(out)]
        silu_mul: Callable[[torch.Tensor], torch.Tensor],  # [n, in] -> [n, sum(out) / 2]
        weight: torch.Tensor | None = None,  # the merged weight where it is a plain one
        fp8: tuple[torch.Tensor, torch.Tensor] | None = None,  # e4m3 [sum(out), in], scales
    ):
        self.linear = linear
        # For gate/up: silu(gate) * up of the merged output, in one kernel where the decode
        # GEMV serves the batch.
        self.silu_mul = silu_mul
        self.weight = weight
        # fp8 merged weights (per-row float32 scales): for the norm prologue only (never a
        # LoRA fold: that is `weight`'s, plain weights only)
        self.fp8 = fp8


def _plain_merged(merged: torch.Tensor, parts: list[ColumnParallelLinear]) -> _MergedWeight:
    """The parts' weights become row blocks (views) of `merged` [>= sum(out), in], whose first
    sum(out) rows are the merged weight."""
    at = 0
    for m in parts:
        rows = m.weight.shape[0]
        m.weight.data = merged[at : at + rows]
        at += rows
    base = merged[:at]
    return _MergedWeight(lambda x: decode_linear.linear(x, base),
                         lambda x: decode_linear.gate_up_silu(x, base), base)


def _merge_rows(parts: list[ColumnParallelLinear]) -> _MergedWeight | None:
    """One [sum(out), in] weight whose row blocks back the parts' weights (their weights become
    views: no extra memory). Plain weights, fp8 weights (each row keeps its scale) and packed int
    weights of one group layout merge; None otherwise."""
    if all(m.quantized is None and m.weight is not None and m.bias is None for m in parts):
        return _plain_merged(torch.cat([m.weight.data for m in parts]), parts)
    # fp8 parts merge on CUDA only: the merged fp8 entry points are the Triton GEMV / _scaled_mm.
    if all(isinstance(m.quantized, Fp8Linear) and m.quantized.bias is None
           and m.quantized.weight.is_cuda for m in parts):
        fp8 = Fp8Linear.merge_rows(*(m.quantized for m in parts))
        return _MergedWeight(fp8, fp8.forward_silu_mul, fp8=(fp8.weight, fp8.weight_scale))
    # Packed int4 / int8 parts (GPTQ / AWQ / compressed-tensors) with the same group layout.
    if all(isinstance(m.quantized, IntLinear) for m in parts):
        packed = IntLinear.merge_rows(*(m.quantized for m in parts))
        if packed is not None:
            return _MergedWeight(packed, packed.forward_silu_mul)
    # W8A8-int8 parts: one activation quantization and one int8 GEMM.
    if all(isinstance(m.quantized, W8A8Linear) for m in parts):
        w8a8 = W8A8Linear.merge_rows(*(m.quantized for m in parts))
        if w8a8 is not None:
            return _MergedWeight(w8a8, w8a8.forward_silu_mul)
    return None


# Gated-MLP activations forward_act_mul serves (config names; gelu_pytorch_tanh and the
# gelu_new / gelu_fast spellings are the same tanh approximation in transformers).
GATED_ACTIVATIONS = frozenset({"silu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast"})


class MergedColumnParallelLinear(nn.Module, WeightLoader):
    """Column-parallel linears over the same input, e.g. q/k/v or gate/up, as one layer.

    The checkpoint stores the parts side by side (`{parent}.q_proj.weight`, ...), or fused into
    one tensor under the layer's name (fused_checkpoint): the layer's loader reads each part under
    its own name from the layer's parent prefix, or its rows of the fused tensor (as a
    ColumnParallelLinear, quantized alike). With `merge`, the parts' weights then become row blocks of one
    merged weight where they can (no bias; 16-bit weights, or fp8 weights on CUDA), and inputs
    take one GEMM / GEMV for all parts (on CPU too: fewer, larger matmuls per decode step)."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, dist: Dist,
                 merge: bool, row_blocks: dict[str, tuple[int, int]] | None = None,
                 fused_checkpoint: bool = False):
        super().__init__()
        # fused_checkpoint: the checkpoint stores the parts as one tensor under this layer's own
        # name (`{prefix}.weight`, rows in part order: Phi-3's qkv_proj and gate_up_proj), not
        # side by side; each part reads its rows of it.
        self.fused_checkpoint = fused_checkpoint
        self.full_sizes = dict(parts)  # part name -> output features over all ranks
        # part name -> ColumnParallelLinear of its full output features, split over the ranks or
        # as row_blocks names it (replicated KV heads: the block this rank reads)
        blocks = row_blocks or {}
        self.parts = nn.ModuleDict({
            name: ColumnParallelLinear(in_features, out, bias, dist, blocks.get(name))
            for name, out in parts.items()
        })
        self.sizes = [p.out_local for p in self.parts.values()]  # output features per part
        self.merge = merge
        self.merged: _MergedWeight | None = None
        # Resident LoRA adapters of all parts (shard/lora attaches them when --max-loras > 0).
        self.lora: LoraWeights | None = None
        # [sum(out) + E, in] with LoRA on a plain merged weight: the merged weight (its first
        # rows, which the parts' weights view) and every slot's A (LoraWeights.fold_into).
        self.lora_weight: torch.Tensor | None = None
        self._norm_warm = False  # forward_add_rms_norm's launch compiled

    def attach_lora(self, lora: LoraWeights) -> None:
        """Adapters on all parts; folded into the merged weight where it is a plain one
        (column-parallel: each rank's A is whole, its h exact)."""
        self.lora = lora
        if self.merged is not None and self.merged.weight is not None:
            wide = lora.fold_into(self.merged.weight)
            if wide is not None:
                self.merged = _plain_merged(wide, list(self.parts.values()))
                self.lora_weight = wide

    def load(self, weights: Weights, prefix: str) -> None:
        parent, offset = prefix.rpartition(".")[0], 0
        for name, part in self.parts.items():
            if self.fused_checkpoint:
                part.load_rows_of(weights, prefix, offset)
                offset += self.full_sizes[name]
            else:
                part.load(weights, f"{parent}.{name}" if parent else name)
        if self.merge:
            self.merged = _merge_rows(list(self.parts.values()))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [n, in] -> each part's output [n, out_local]."""
        lora = self.lora if self.lora is not None and self.lora.batch.active else None
        if lora is not None and self.lora_weight is not None:  # the base GEMM computes h too
            y = lora.expand_folded(linear(x, self.lora_weight))  # [n, sum(out_local)]
            return list(y.split(self.sizes, dim=-1))
        if self.merged is not None:  # one GEMM / GEMV for all parts
            y = self.merged.linear(x)  # [n, sum(out_local)]
            if lora is not None:
                lora.apply_(x, y)
            return list(y.split(self.sizes, dim=-1))
        outs = [part(x) for part in self.parts.values()]
        if lora is not None:  # one shrink + expand for every part: on their concatenation
            y = torch.cat(outs, dim=-1)
            lora.apply_(x, y)
            return list(y.split(self.sizes, dim=-1))
        return outs

    def forward_add_rms_norm(self, delta: torch.Tensor, x: torch.Tensor,
                             norm_weight: torch.Tensor, eps: float, weight_offset: float = 0.0,
                             ) -> tuple[list[torch.Tensor], torch.Tensor] | None:
        """(each part's output for RMSNorm(x + delta), x + delta) in one launch, where the
        opt-in norm prologue is on and serves: CUDA, a plain or fp8 merged weight, no LoRA,
        Llama's norm, a few tokens (norm_gemv.applies). None otherwise: the caller runs add + norm,
        then forward. delta must already be summed over ranks (the caller's concern)."""
        if not (_NORM_PROLOGUE.value and x.is_cuda and x.dim() == 2 and x.shape[0]):
            return None
        if (not self._norm_warm and not torch.cuda.is_current_stream_capturing()
                and self.norm_prologue_serves(delta[:1], x[:1], weight_offset)):
            # compiled at the first eager call whatever its size (warm-up's prefill): no compile
            # while serving, graphs or not
            self.forward_add_rms_norm_fused(delta[:1], x[:1], norm_weight, eps)
            self._norm_warm = True
        if not self.norm_prologue_serves(delta, x, weight_offset):
            return None
        return self.forward_add_rms_norm_fused(delta, x, norm_weight, eps)

    def norm_prologue_serves(self, delta: torch.Tensor, x: torch.Tensor,
                             weight_offset: float = 0.0) -> bool:
        """Whether the norm prologue's launch computes this call (see forward_add_rms_norm)."""
        from shard.kernels import norm_gemv  # lazy: triton

        m = self.merged
        if (weight_offset or self.lora is not None or m is None
                or (m.weight is None and m.fp8 is None) or x.dim() != 2
                or delta.shape != x.shape or x.stride(1) != 1 or delta.stride(1) != 1):
            return False
        if m.weight is not None:
            return norm_gemv.applies(x, m.weight)
        assert m.fp8 is not None
        return norm_gemv.applies(x, *m.fp8)

    def forward_add_rms_norm_fused(self, delta: torch.Tensor, x: torch.Tensor,
                                   norm_weight: torch.Tensor, eps: float
                                   ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """forward_add_rms_norm's launch (the caller checked norm_prologue_serves; the
        interpreter tests call it on CPU tensors)."""
        from shard.kernels import norm_gemv

        m = self.merged
        assert m is not None
        if m.weight is not None:
            y, residual = norm_gemv.add_rms_norm_linear(delta, x, norm_weight, eps, m.weight)
        else:
            assert m.fp8 is not None
            y, residual = norm_gemv.add_rms_norm_linear(delta, x, norm_weight, eps, m.fp8[0],
                                                        scale=m.fp8[1])
        return list(y.split(self.sizes, dim=-1)), residual

    def forward_act_mul(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """For two parts (gate, up): act(gate(x)) * up(x), [n, in] -> [n, out_local], for the
        config's hidden_act / hidden_activation: "silu" (forward_silu_mul: fused into the GEMV
        where tuned so) or "gelu_pytorch_tanh" (Gemma: one GEMM / GEMV, then one kernel)."""
        if activation == "silu":
            return self.forward_silu_mul(x)
        if activation not in GATED_ACTIVATIONS:
            raise NotImplementedError(f"gated MLP activation {activation!r} is not supported "
                                      f"(supported: {', '.join(sorted(GATED_ACTIVATIONS))})")
        gate, up = self.forward(x)  # [n, out_local] each (LoRA deltas included)
        if x.is_cuda:
            from shard.kernels.elementwise import gelu_tanh_mul

            return gelu_tanh_mul(gate, up)
        return F.gelu(gate, approximate="tanh") * up

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """For two parts (gate, up): silu(gate(x)) * up(x), [n, in] -> [n, out_local]; one
        kernel for the SiLU-and-mul on CUDA, one pass over the merged weight where merged."""
        if self.lora is not None and self.lora.batch.active and self.lora_weight is not None:
            # [n, 2 * out_local + E] -> one kernel: expand, SiLU-and-mul
            return self.lora.silu_mul_folded(linear(x, self.lora_weight))
        if self.lora is not None and self.lora.batch.active:
            # the adapters' deltas need the unfused outputs; the LoRA expand then does the
            # SiLU-and-mul (one kernel on CUDA)
            if self.merged is not None:
                y = self.merged.linear(x)  # [n, 2 * out_local]
            else:
                y = torch.cat([part(x) for part in self.parts.values()], dim=-1)
            return self.lora.silu_mul(x, y)
        if self.merged is not None:
            return self.merged.silu_mul(x)
        gate, up = self.parts.values()
        if x.is_cuda:
            from shard.kernels.elementwise import silu_mul

            return silu_mul(gate(x), up(x))
        return F.silu(gate(x)) * up(x)
