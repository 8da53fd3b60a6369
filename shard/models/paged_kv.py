"""The KV-cache half of CausalLM for native models, whose attention layers are PagedAttention
modules: fp8 calibration, bytes per block, allocation. Llama's and Gemma's families mix it in."""

from __future__ import annotations

import torch

from shard.layers.attention import PagedAttention
from shard.quantization.kv_cache import KvScales

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (key, value) pools


class PagedKVCacheModel:
    """Mixed into a native model class that sets `attns` (its PagedAttention modules, one per
    layer, all with the same KV heads, head size and cache dtype) and `_device`."""

    attns: list[PagedAttention]
    _device: torch.device

    def begin_kv_calibration(self) -> bool:
        # Every layer starts recording (a list, not a generator: any() would stop at the first).
        return any([a.begin_kv_calibration() for a in self.attns])  # noqa: C419

    def finish_kv_calibration(self, headroom: float | None = None) -> list[KvScales]:
        return [s for a in self.attns if (s := a.finish_kv_calibration(headroom)) is not None]

    def kv_bytes_per_block(self, block_size: int) -> int:
        a = self.attns[0]
        elem = torch.empty((), dtype=a.kv_dtype).element_size()
        return 2 * len(self.attns) * block_size * a.num_kv_heads * a.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        a = self.attns[0]
        # [num_blocks, block_size, num_kv_heads, head_dim] per pool, key and value per layer
        shape, kw = (num_blocks, block_size, a.num_kv_heads, a.head_dim), {
            "dtype": a.kv_dtype, "device": self._device}
        return [(torch.zeros(shape, **kw), torch.zeros(shape, **kw)) for _ in self.attns]
