"""What the native model classes share beyond their layers: the KV-cache half of CausalLM (their
attention layers are PagedAttention modules: fp8 calibration, bytes per block, allocation), and
the end of their construction (CUDA-graph safety from the quantization, loading the weights,
tying the LM head). Llama's and Gemma's families use it."""

from __future__ import annotations

import torch
from torch import nn

from shard.layers.attention import PagedAttention
from shard.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shard.layers.weights import Weights, load_module_weights
from shard.models.base import LoadContext
from shard.quantization import QuantizeMethod
from shard.quantization.kv_cache import KvScales
from shard.quantization.loading import LinearQuantization

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


def graph_safe(quant: LinearQuantization | None) -> bool:
    """Whether a native model's decode step may be captured in CUDA graphs: bitsandbytes'
    LLM.int8() outlier path syncs with the host; every other kernel reads device tensors only."""
    return quant is None or quant.flag not in (
        QuantizeMethod.BITSANDBYTES, QuantizeMethod.BITSANDBYTES_NF4
    )


def load_weights(model: nn.Module, ctx: LoadContext, quant: LinearQuantization | None,
                 embed: VocabParallelEmbedding, lm_head: ParallelLMHead, tied: bool) -> None:
    """Loads every tensor of `model` from the checkpoint; the LM head shares the embedding where
    the config ties them (`tied`) or the checkpoint omits lm_head.weight (as tied ones do; a
    head stored quantized, shard/quantization/embedding.py, is the checkpoint's own)."""
    from shard.quantization.embedding import stored_int_rows

    weights = Weights(ctx.model_dir, ctx.device, ctx.dtype, ctx.dist, quant)
    tie = tied or not (weights.has("lm_head.weight") or stored_int_rows(weights, "lm_head"))
    load_module_weights(model, weights, skip=frozenset({"lm_head"} if tie else ()))
    if tie:
        lm_head.tie_to(embed)
