"""Quantization: fp8 / bitsandbytes int8 / nf4 / packed int4-int8 (GPTQ, AWQ, compressed-tensors,
GGUF snapshots) / W8A8-int8 linear weights and the fp8 KV cache.

Model code needs three things from here:
- `parse_quantize(flag) -> QuantizeMethod | None` and `make_linear_weights(weight, bias, method)`
  (after TP slicing) for every linear layer; `checkpoint_quantization(config_dict)` says when the
  checkpoint itself is fp8 and `make_fp8_linear_from_checkpoint` builds its layers.
- `parse_kv_cache_dtype(flag)`, `kv_cache_torch_dtype(...)`, `kv_cache_bytes_per_token(...)` for KV
  cache allocation, and `write_kv` / `read_blocks` (kv_cache.py) in the torch attention backend.
Heavy or optional imports (bitsandbytes) happen only when a method asks for them.
"""

from shard.quantization.kv_cache import (
    KvScales,
    kv_cache_bytes_per_block,
    kv_cache_bytes_per_token,
    kv_cache_torch_dtype,
    read_blocks,
    write_kv,
)
from shard.quantization.linear import (
    DenseLinear,
    linear_weight_bytes,
    make_fp8_linear_from_checkpoint,
    make_linear_weights,
)
from shard.quantization.methods import (
    KV_CACHE_DTYPE_CHOICES,
    KV_CACHE_ROTATION_CHOICES,
    QUANTIZE_CHOICES,
    CheckpointQuantization,
    Fp8ScaleLayout,
    IntLayout,
    IntWeightFormat,
    KvCacheDtype,
    KvCacheRotation,
    QuantizeMethod,
    checkpoint_quantization,
    parse_kv_cache_dtype,
    parse_kv_cache_rotation,
    parse_quantize,
    with_quantize_config,
)

__all__ = [
    "KV_CACHE_DTYPE_CHOICES",
    "KV_CACHE_ROTATION_CHOICES",
    "QUANTIZE_CHOICES",
    "CheckpointQuantization",
    "DenseLinear",
    "Fp8ScaleLayout",
    "IntLayout",
    "IntWeightFormat",
    "KvCacheDtype",
    "KvCacheRotation",
    "KvScales",
    "QuantizeMethod",
    "checkpoint_quantization",
    "kv_cache_bytes_per_block",
    "kv_cache_bytes_per_token",
    "kv_cache_torch_dtype",
    "linear_weight_bytes",
    "make_fp8_linear_from_checkpoint",
    "make_linear_weights",
    "parse_kv_cache_dtype",
    "parse_kv_cache_rotation",
    "parse_quantize",
    "read_blocks",
    "with_quantize_config",
    "write_kv",
]
