"""fp8 KV cache (`--kv-cache-dtype fp8_e4m3fn`): K/V stored as float8 with one scale per tensor
per layer.

Layout is unchanged ([num_blocks, block_size, num_kv_heads, head_dim] per layer, see
shard/attention/base.py); only the element type is float8, so a block takes half the bytes of a
bf16 block and the same memory fraction holds twice the tokens (the warmup sizing divides usable
memory by `kv_cache_bytes_per_block`).

Scales: one float per layer for K and one for V (stored value = K / k_scale, read value =
stored * k_scale). They default to 1.0, which suits the usual range of post-RoPE keys and values
(|x| up to a few hundred fits e4m3's ±448; relative precision is 2^-4 for |x| >= 2^-6). A
checkpoint that ships calibrated `k_scale` / `v_scale` tensors (llm-compressor / AutoFP8) can
set them, and `calibrate_scale` derives one from observed values (e.g. during warmup). Scales are
Python floats fixed before CUDA-graph capture, so stores and reads need no device tensor
lookups. Values beyond ±448 * scale saturate rather than become NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shard.quantization.methods import KvCacheDtype

FP8_MAXES = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def kv_cache_torch_dtype(kv_dtype: KvCacheDtype, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of the cache tensors."""
    if kv_dtype is KvCacheDtype.FP8_E4M3FN:
        return torch.float8_e4m3fn
    if kv_dtype is KvCacheDtype.FP8_E5M2:
        return torch.float8_e5m2
    return model_dtype


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype in FP8_MAXES


def kv_cache_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype
) -> int:
    """Bytes one token's K and V take over all layers (num_kv_heads is this rank's share)."""
    element = torch.empty((), dtype=cache_dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * element


def kv_cache_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype, block_size: int
) -> int:
    return block_size * kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, cache_dtype)


@dataclass
class KvScales:
    """Per-layer scales of an fp8 cache (plain floats: no device lookups, graph-capture safe)."""

    k_scale: float = 1.0
    v_scale: float = 1.0


def calibrate_scale(
    x: torch.Tensor, cache_dtype: torch.dtype = torch.float8_e4m3fn, headroom: float = 2.0
) -> float:
    """A per-tensor scale under which `headroom` times x's absmax still fits (one host sync)."""
    amax = float(x.detach().abs().amax().float()) if x.numel() else 0.0
    return max(amax * headroom / FP8_MAXES[cache_dtype], 1.0) if amax > 0 else 1.0


def quantize_kv(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x (any float dtype) -> x / scale as cache_dtype, saturating at the format's max."""
    fmax = FP8_MAXES[cache_dtype]
    xf = x.float()
    if scale != 1.0:
        xf = xf / scale
    return xf.clamp(-fmax, fmax).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache elements (fp8) -> values in `dtype`. Works on any gathered view (blocks, slots)."""
    y = x.to(dtype) if scale == 1.0 else x.float() * scale
    return y.to(dtype)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, slot = block * block_size + offset
    scales: KvScales | None = None,
) -> None:
    """Stores new K/V at their slots, quantizing when the cache is fp8 (model dtype otherwise)."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    if is_fp8_cache(key_cache):
        s = scales or KvScales()
        key = quantize_kv(key, s.k_scale, key_cache.dtype)
        value = quantize_kv(value, s.v_scale, value_cache.dtype)
    else:
        key = key.to(key_cache.dtype)
        value = value.to(value_cache.dtype)
    if is_fp8_cache(key_cache) and key_cache.device.type == "cpu":
        # index_copy_ has no CPU kernel for float8: copy the raw bytes instead.
        flat_k.view(torch.uint8).index_copy_(0, slot_mapping, key.view(torch.uint8))
        flat_v.view(torch.uint8).index_copy_(0, slot_mapping, value.view(torch.uint8))
    else:
        flat_k.index_copy_(0, slot_mapping, key)
        flat_v.index_copy_(0, slot_mapping, value)


def read_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int, block ids of one sequence in order
    scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:  # [n * block_size, num_kv_heads, head_dim] in `dtype`
    """Gathers a sequence's blocks and dequantizes only those (fp8) or casts (otherwise)."""
    gathered = cache.index_select(0, block_ids)  # [n, block_size, num_kv_heads, head_dim]
    flat = gathered.reshape(-1, *cache.shape[2:])
    if is_fp8_cache(cache):
        return dequantize_kv(flat, scale, dtype)
    return flat.to(dtype)
