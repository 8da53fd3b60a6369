"""Model code: a registry from config.json `model_type` to the class that serves it."""

from __future__ import annotations

import logging
from collections.abc import Callable

from shard.models.base import CausalLM, LoadContext

log = logging.getLogger(__name__)


def _llama(ctx: LoadContext) -> CausalLM:
    from shard.models.llama import LlamaForCausalLM

    return LlamaForCausalLM(ctx)


def _fallback(ctx: LoadContext) -> CausalLM:
    from shard.models.hf_fallback import HFFallbackForCausalLM

    return HFFallbackForCausalLM(ctx)


def model_registry() -> dict[str, Callable[[LoadContext], CausalLM]]:
    """model_type -> constructor of our own implementations."""
    return {"llama": _llama, "mistral": _llama, "qwen2": _llama}


def load_model(ctx: LoadContext, force_fallback: bool = False) -> CausalLM:
    """Our implementation for the config's model_type, else the transformers fallback."""
    model_type = ctx.config.get("model_type", "")
    factory = None if force_fallback else model_registry().get(model_type)
    if factory is None:
        if ctx.quantize is not None or ctx.kv_cache_dtype.is_fp8:
            raise ValueError(
                f"--quantize / --kv-cache-dtype need tokenwire's own model code; model_type "
                f"{model_type!r} is served by the transformers fallback, which supports neither"
            )
        if ctx.dist.world_size > 1:
            log.warning("model_type %r uses the fallback: replicated on every rank", model_type)
        return _fallback(ctx)
    return factory(ctx)


__all__ = ["CausalLM", "LoadContext", "load_model", "model_registry"]
