"""fp8 KV cache (`--kv-cache-dtype fp8_e4m3fn`): K/V stored as float8 with one scale per layer
and KV head, calibrated at warmup.

Layout is unchanged ([num_blocks, block_size, num_kv_heads, head_dim] per layer, see
shard/attention/base.py); only the element type is float8, so a block takes half the bytes of a
bf16 block and the same memory fraction holds twice the tokens (the warmup sizing divides usable
memory by `kv_cache_bytes_per_block`).

Scales: per layer, a K and a V scale per KV head ([num_kv_heads] float32 on the device, beside
the layer's cache; stored value = x / scale, read value = stored * scale). Why per head and
calibrated: e4m3 keeps 3 mantissa bits only for |x| >= 2^-6; below that (subnormals) relative
precision collapses. With a fixed scale of 1 the small K/V of many models (and every tiny test
model) sit in that range, so the cache rounded them to a handful of levels. Warmup's worst-case
prefill records each head's |K| and |V| maximum (`KvCalibration`); the scale maps `headroom` x
that maximum to e4m3's 448, so every value of normal size keeps full relative precision (~3%
rounding at worst) and a later token up to `headroom` x larger than anything seen still fits;
larger ones saturate (never NaN). Scales are fixed before CUDA-graph capture and live at fixed
device addresses, so captured graphs read the calibrated values. Kernels fold them into the math
(scores * k_scale, output * v_scale per KV head), which is exact.
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


Scale = float | torch.Tensor  # a float, or [num_kv_heads] float32 (one per KV head)


@dataclass
class KvScales:
    """K and V scales of one layer's fp8 cache (floats, or [num_kv_heads] device tensors)."""

    k_scale: Scale = 1.0
    v_scale: Scale = 1.0


DEFAULT_HEADROOM = 4.0


def calibrate_scale(
    x: torch.Tensor, cache_dtype: torch.dtype = torch.float8_e4m3fn, headroom: float = 2.0
) -> float:
    """A per-tensor scale under which `headroom` times x's absmax still fits (one host sync);
    never below 1 (kept for checkpoints' per-tensor scales; the cache uses per-head scales)."""
    amax = float(x.detach().abs().amax().float()) if x.numel() else 0.0
    return max(amax * headroom / FP8_MAXES[cache_dtype], 1.0) if amax > 0 else 1.0


def scales_from_amax(
    amax: torch.Tensor,  # [num_kv_heads] float32, observed max |x| per head
    cache_dtype: torch.dtype = torch.float8_e4m3fn,
    headroom: float = DEFAULT_HEADROOM,
) -> torch.Tensor:  # [num_kv_heads] float32
    """scale = headroom * amax / fmax per head (1.0 where a head saw nothing)."""
    s = amax.float() * headroom / FP8_MAXES[cache_dtype]
    return torch.where(amax > 0, s.clamp_min(1e-12), torch.ones_like(s))


class KvCalibration:
    """Running max |K| and |V| per KV head of one layer (updated on the device, no host syncs)."""

    def __init__(self, num_kv_heads: int, device: torch.device):
        self.k_amax = torch.zeros(num_kv_heads, dtype=torch.float32, device=device)
        self.v_amax = torch.zeros(num_kv_heads, dtype=torch.float32, device=device)

    def observe(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> None:
        if key.shape[0]:
            torch.maximum(self.k_amax, key.detach().abs().amax(dim=(0, 2)).float(), out=self.k_amax)
            torch.maximum(self.v_amax, value.detach().abs().amax(dim=(0, 2)).float(),
                          out=self.v_amax)


def _per_head(scale: Scale, x: torch.Tensor) -> Scale:
    """A per-head scale tensor broadcast over [..., num_kv_heads, head_dim]; floats unchanged."""
    if isinstance(scale, torch.Tensor):
        return scale.to(x.device, torch.float32).view(-1, 1)
    return scale


def quantize_kv(x: torch.Tensor, scale: Scale, cache_dtype: torch.dtype) -> torch.Tensor:
    """x [..., num_kv_heads, head_dim] (any float dtype) -> x / scale as cache_dtype, saturating
    at the format's max."""
    fmax = FP8_MAXES[cache_dtype]
    xf = x.float()
    if isinstance(scale, torch.Tensor) or scale != 1.0:
        xf = xf / _per_head(scale, xf)
    return xf.clamp(-fmax, fmax).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, scale: Scale, dtype: torch.dtype) -> torch.Tensor:
    """Cache elements (fp8) [..., num_kv_heads, head_dim] -> values in `dtype`. Works on any
    gathered view (blocks, slots)."""
    if not isinstance(scale, torch.Tensor) and scale == 1.0:
        return x.to(dtype)
    return (x.float() * _per_head(scale, x)).to(dtype)


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
    if is_fp8_cache(key_cache):
        # index_copy_ has no float8 kernel (CPU or CUDA): copy the raw bytes instead.
        flat_k.view(torch.uint8).index_copy_(0, slot_mapping, key.view(torch.uint8))
        flat_v.view(torch.uint8).index_copy_(0, slot_mapping, value.view(torch.uint8))
    else:
        flat_k.index_copy_(0, slot_mapping, key)
        flat_v.index_copy_(0, slot_mapping, value)


def read_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int, block ids of one sequence in order
    scale: Scale,
    dtype: torch.dtype,
) -> torch.Tensor:  # [n * block_size, num_kv_heads, head_dim] in `dtype`
    """Gathers a sequence's blocks and dequantizes only those (fp8) or casts (otherwise)."""
    gathered = cache.index_select(0, block_ids)  # [n, block_size, num_kv_heads, head_dim]
    flat = gathered.reshape(-1, *cache.shape[2:])
    if is_fp8_cache(cache):
        return dequantize_kv(flat, scale, dtype)
    return flat.to(dtype)
