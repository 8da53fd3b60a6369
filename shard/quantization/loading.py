"""Quantization at weight-loading time: the tensor-parallel linears call `quantize_loaded_linear`
right after reading their slice, so only one layer's float weight exists at a time.

`LinearQuantization.resolve(--quantize, config.json)` decides once per model:
- plain checkpoint, no flag: None (dense layers, nothing changes);
- plain checkpoint, --quantize M: quantize every TP linear with M (embeddings, norms and the LM
  head stay in the model dtype);
- pre-quantized fp8 checkpoint (config `quantization_config`), no flag or --quantize fp8: keep the
  checkpoint's fp8 weights (scales converted to per channel, see fp8.to_per_channel);
- pre-quantized fp8 checkpoint with --quantize bitsandbytes[-nf4]: dequantize, then re-quantize.
The layer reads `{prefix}.weight` through the normal loader, which casts to the model dtype: fp8
e4m3 values are exact in bf16/fp16/fp32, so nothing is lost; the scales are read uncast.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from shard.quantization.linear import make_linear_weights
from shard.quantization.methods import (
    CheckpointQuantization,
    Fp8ScaleLayout,
    QuantizeMethod,
    checkpoint_quantization,
)


class WeightSource(Protocol):
    """What shard/layers/weights.py's Weights offers (duck-typed to keep this package independent)."""

    dtype: torch.dtype
    device: torch.device

    def has(self, name: str) -> bool: ...

    def get(self, name: str, raw: bool = False) -> torch.Tensor: ...

    def get_sharded(self, name: str, dim: int, raw: bool = False) -> torch.Tensor: ...

    @property
    def dist(self) -> Any: ...


@dataclass(frozen=True)
class LinearQuantization:
    """How this model's tensor-parallel linears are stored (see module docstring)."""

    flag: QuantizeMethod | None  # --quantize
    checkpoint: CheckpointQuantization | None = None  # set when the checkpoint is pre-quantized

    @classmethod
    def resolve(
        cls, flag: QuantizeMethod | None, config: Mapping[str, Any]
    ) -> LinearQuantization | None:
        stored = checkpoint_quantization(config)
        if stored is None and flag is None:
            return None
        return cls(flag, stored)


def quantize_loaded_linear(
    weights: WeightSource,
    prefix: str,
    weight: torch.Tensor,  # [out_local, in_local] as loaded (model dtype; fp8 values if stored so)
    bias: torch.Tensor | None,  # [out] applied by the module (None for row-parallel layers)
    shard_dim: int,  # 0: column-parallel (rows split), 1: row-parallel (columns split)
    quant: LinearQuantization,
) -> nn.Module:
    """The module that replaces F.linear(x, weight, bias) for this layer."""
    stored = quant.checkpoint
    has_scale = stored is not None and (
        weights.has(f"{prefix}.weight_scale") or weights.has(f"{prefix}.weight_scale_inv")
    )
    if not has_scale:
        # Stored in the model dtype (plain checkpoint, or a layer the fp8 checkpoint left alone).
        return make_linear_weights(weight, bias, quant.flag, compute_dtype=weights.dtype)
    scale, block = _local_scale(weights, prefix, weight.shape, shard_dim, stored)
    q = weight.to(torch.float8_e4m3fn)  # exact: the loader's cast from fp8 was lossless
    if quant.flag in (None, QuantizeMethod.FP8):
        from shard.quantization.linear import make_fp8_linear_from_checkpoint

        return make_fp8_linear_from_checkpoint(q, scale, bias, block_size=block)
    from shard.quantization.fp8 import dequantize_fp8, to_per_channel

    q, per_channel = to_per_channel(q, scale, block)
    dense = dequantize_fp8(q, per_channel, weights.dtype)
    return make_linear_weights(dense, bias, quant.flag, compute_dtype=weights.dtype)


def _local_scale(
    weights: WeightSource,
    prefix: str,
    local_shape: torch.Size,
    shard_dim: int,
    stored: CheckpointQuantization,
) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """This rank's part of the layer's scale tensor (float32) and the block shape if blocks."""
    name = f"{prefix}.weight_scale"
    if not weights.has(name):
        name = f"{prefix}.weight_scale_inv"  # DeepSeek-style name; a multiplier all the same
    scale = weights.get(name, raw=True).float()
    world = weights.dist.world_size
    rank = weights.dist.rank
    if stored.scale_layout is Fp8ScaleLayout.BLOCK or (scale.dim() == 2 and scale.shape[1] > 1):
        if stored.weight_block_size is None:
            raise ValueError(
                f"{name}: block scales but no weight_block_size in quantization_config"
            )
        block = stored.weight_block_size
        if world > 1:
            local = local_shape[shard_dim]
            if local % block[shard_dim]:
                raise ValueError(
                    f"{name}: this rank's {local} {'rows' if shard_dim == 0 else 'columns'} are "
                    f"not a multiple of the fp8 block size {block[shard_dim]}; use fewer shards"
                )
            per_rank = local // block[shard_dim]
            scale = scale.narrow(shard_dim, rank * per_rank, per_rank)
        return scale, block
    if scale.numel() > 1 and shard_dim == 0 and world > 1:
        # Per-channel scales follow the rows of a column-parallel slice.
        out_local = local_shape[0]
        scale = scale.reshape(-1).narrow(0, rank * out_local, out_local)
    return scale, None
