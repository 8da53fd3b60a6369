"""The one entry point model code uses: turn a (TP-sliced) float weight into a linear module."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shard.quantization.methods import QuantizeMethod


class DenseLinear(nn.Module):
    """Unquantized y = x @ W.T + b, with the same interface as the quantized modules."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    @property
    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def make_linear_weights(
    weight: torch.Tensor,  # [out, in], this rank's slice, on its final device
    bias: torch.Tensor | None,  # [out] or None
    method: QuantizeMethod | None,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Returns a module computing x @ weight.T + bias for x [..., in] -> [..., out], its weight
    stored as `method` says (None: unquantized). Each module exposes `weight_bytes`.

    Tensor parallel: call it after slicing, once per rank; column-parallel slices keep their own
    per-row scales and row-parallel slices quantize their own input columns, so the per-rank
    results sum to the full product exactly as the unquantized layers do (the all-reduce stays in
    the caller). compute_dtype (default: weight.dtype) is the activation dtype for nf4.
    """
    if method is None:
        return DenseLinear(weight, bias)
    if method is QuantizeMethod.FP8:
        from shard.quantization.fp8 import Fp8Linear

        return Fp8Linear.from_float(weight, bias)
    from shard.quantization.bnb import BnbLinear

    return BnbLinear(weight, bias, method, compute_dtype=compute_dtype)


def make_fp8_linear_from_checkpoint(
    weight_fp8: torch.Tensor,  # [out, in] float8_e4m3fn, this rank's slice
    weight_scale: torch.Tensor,  # per tensor, per channel ([out] / [out, 1], sliced alike) or blocks
    bias: torch.Tensor | None,
    block_size: tuple[int, int] | None = None,
) -> nn.Module:
    """An Fp8Linear straight from a pre-quantized checkpoint's tensors, no float round trip for
    per-tensor/per-channel scales (see fp8.to_per_channel)."""
    from shard.quantization.fp8 import FP8_DTYPE, Fp8Linear, to_per_channel

    if weight_fp8.dtype != FP8_DTYPE:
        weight_fp8 = weight_fp8.to(FP8_DTYPE)
    q, scale = to_per_channel(weight_fp8, weight_scale.to(weight_fp8.device), block_size)
    return Fp8Linear(q, scale, bias)


def linear_weight_bytes(module: nn.Module) -> int:
    """Bytes of every linear weight (quantized or not) under `module`, for memory reports."""
    total = 0
    for sub in module.modules():
        wb = getattr(type(sub), "weight_bytes", None)
        if isinstance(wb, property):
            total += sub.weight_bytes
    return total
