"""Quantization at weight-loading time: the tensor-parallel linears call `quantize_loaded_linear`
right after reading their slice, so only one layer's float weight exists at a time.

`LinearQuantization.resolve(--quantize, config.json)` decides once per model:
- plain checkpoint, no flag: None (dense layers, nothing changes);
- plain checkpoint, --quantize M: quantize every TP linear with M (embeddings, norms and the LM
  head stay in the model dtype);
- pre-quantized fp8 checkpoint (config `quantization_config`), no flag or --quantize fp8: keep the
  checkpoint's fp8 weights (scales converted to per channel, see fp8.to_per_channel);
- pre-quantized fp8 checkpoint with --quantize bitsandbytes[-nf4]: dequantize, then re-quantize;
- pre-quantized GPTQ / AWQ checkpoint (no flag): each linear reads its packed tensors
  (`{prefix}.qweight`, ...) through `load_int_linear` instead of `{prefix}.weight` and keeps them
  packed (int_weights.py); --quantize with such a checkpoint is refused at start-up. The same
  holds for compressed-tensors int checkpoints (W8A8-int8 ones become w8a8.W8A8Linear) and for
  GGUF snapshots converted with their linears kept packed (gguf_blocks.py).
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
    IntLayout,
    IntWeightFormat,
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
        if stored is not None and stored.packed is not None and flag is not None:
            raise ValueError(
                f"{flag.flag}: the checkpoint is already quantized "
                f"({stored.packed.layout.value}, {stored.packed.bits}-bit); drop --quantize"
            )
        return cls(flag, stored)

    @property
    def packed(self) -> IntWeightFormat | None:
        """The integer format of a GPTQ / AWQ checkpoint's linears, else None."""
        return None if self.checkpoint is None else self.checkpoint.packed


def load_int_linear(
    weights: WeightSource,
    prefix: str,
    bias: torch.Tensor | None,  # [out_local] applied by the module (None for row-parallel)
    shard_dim: int,  # 0: column-parallel (rows split), 1: row-parallel (input features split)
    fmt: IntWeightFormat,
) -> nn.Module:
    """An IntLinear (W8A8Linear for int-quantized checkpoints) from a GPTQ / AWQ /
    compressed-tensors / GGUF-snapshot checkpoint's tensors of one linear, this rank's part
    (int_weights.py: unpacked once, sliced keeping groups and act-order intact, repacked)."""
    from shard.quantization.int_weights import IntLinear, PackedInt, read_unpacked, tp_slice

    stored = {
        suffix: weights.get(f"{prefix}.{suffix}", raw=True)
        for suffix in fmt.layout.tensor_names
        if weights.has(f"{prefix}.{suffix}")
    }
    if fmt.layout is IntLayout.INT_QUANTIZED:
        from shard.quantization.w8a8 import W8A8Linear, read_w8a8

        full = read_w8a8(prefix, stored)
    elif fmt.layout is IntLayout.GGUF:
        from shard.quantization.gguf_blocks import read_gguf_linear

        full = read_gguf_linear(prefix, stored)
    else:
        full = read_unpacked(fmt, prefix, stored)
    local = tp_slice(full, shard_dim, weights.dist.rank, weights.dist.world_size, prefix)
    del full, stored
    if fmt.layout is IntLayout.INT_QUANTIZED:
        return W8A8Linear(local, bias)
    return IntLinear(PackedInt.pack(local), bias)


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
