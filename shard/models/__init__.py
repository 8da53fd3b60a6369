"""Model code: a registry from config.json `model_type` to tokenwire's own implementation, and
the transformers backend (shard/models/transformers_backend.py) for every other decoder-only
architecture that transformers implements with its attention interface."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

from shard.models.base import CausalLM, LoadContext, NotServedNatively

log = logging.getLogger(__name__)


class ModelImpl(enum.Enum):
    """--model-impl: which code serves the model."""

    AUTO = "auto"  # native where tokenwire has code for the model type, else the backend
    NATIVE = "native"  # tokenwire's own code only (fails for other model types)
    TRANSFORMERS = "transformers"  # the transformers backend, even where native code exists


def parse_model_impl(value: str) -> ModelImpl:
    try:
        return ModelImpl(value)
    except ValueError:
        names = " | ".join(m.value for m in ModelImpl)
        raise ValueError(f"--model-impl must be one of {names}; got {value!r}") from None


def _llama(ctx: LoadContext) -> CausalLM:
    from shard.models.llama import LlamaForCausalLM

    return LlamaForCausalLM(ctx)


def _mixtral(ctx: LoadContext) -> CausalLM:
    from shard.models.mixtral import MixtralForCausalLM

    return MixtralForCausalLM(ctx)


def _qwen2_moe(ctx: LoadContext) -> CausalLM:
    from shard.models.qwen2_moe import Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(ctx)


def _qwen3(ctx: LoadContext) -> CausalLM:
    from shard.models.qwen3 import Qwen3ForCausalLM

    return Qwen3ForCausalLM(ctx)


def _qwen3_moe(ctx: LoadContext) -> CausalLM:
    from shard.models.qwen3_moe import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(ctx)


def _olmo2(ctx: LoadContext) -> CausalLM:
    from shard.models.olmo2 import Olmo2ForCausalLM

    return Olmo2ForCausalLM(ctx)


def _phi3(ctx: LoadContext) -> CausalLM:
    from shard.models.phi3 import Phi3ForCausalLM

    return Phi3ForCausalLM(ctx)


def _gemma(ctx: LoadContext) -> CausalLM:
    from shard.models.gemma import GemmaForCausalLM

    return GemmaForCausalLM(ctx)


def _transformers(ctx: LoadContext) -> CausalLM:
    from shard.models.transformers_backend import TransformersCausalLM

    return TransformersCausalLM(ctx)


def model_registry() -> dict[str, Callable[[LoadContext], CausalLM]]:
    """model_type -> constructor of our own implementations."""
    return {"llama": _llama, "mistral": _llama, "qwen2": _llama, "qwen3": _qwen3,
            "olmo2": _olmo2, "phi3": _phi3, "gemma2": _gemma, "gemma3_text": _gemma,
            "mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe}


def load_model(ctx: LoadContext, impl: ModelImpl = ModelImpl.AUTO) -> CausalLM:
    """The model for the config's model_type by --model-impl: native code first (auto), the
    transformers backend where tokenwire has none; the start-up log says which."""
    model_type = ctx.config.get("model_type", "")
    native = model_registry().get(model_type)
    if impl is ModelImpl.NATIVE and native is None:
        known = ", ".join(sorted(model_registry()))
        raise ValueError(f"--model-impl native: tokenwire has no native code for model_type "
                         f"{model_type!r} (native: {known}); use --model-impl auto")
    if native is not None and impl is not ModelImpl.TRANSFORMERS:
        try:
            model = native(ctx)
        # NotImplementedError: a layer option the native layers lack (a rope_type, say)
        except (NotServedNatively, NotImplementedError) as exc:
            if impl is ModelImpl.NATIVE:
                raise ValueError(f"--model-impl native: the native {model_type} code cannot "
                                 f"serve this config: {exc}; use --model-impl auto") from None
            log.warning("model_type %r: the native code cannot serve this config (%s): "
                        "transformers backend", model_type, exc)
            return _transformers(ctx)
        log.info("model_type %r: native tokenwire model code", model_type)
        return model
    if native is not None:
        log.warning("model_type %r: transformers backend forced by --model-impl transformers "
                    "(native code exists)", model_type)
    return _transformers(ctx)


__all__ = ["CausalLM", "LoadContext", "ModelImpl", "load_model", "model_registry",
           "parse_model_impl"]
