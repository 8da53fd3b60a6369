"""Which transformers models the transformers backend serves, and what it declares about them.

Served: a decoder-only config whose transformers causal-LM class routes attention through the
attention interface (the class sets `_supports_attention_backend`, or is listed below after its
code was read and its parity tested) with causal attention modules. Anything else fails at
start-up with one line naming the model type and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from shard.models.transformers_idefics3 import TILED_MODELS
from shard.models.transformers_qwen_vl import MROPE_MODELS
from shard.models.transformers_tp import PACKED
from shard.quantization.loading import LinearQuantization
from shard.quantization.methods import QuantizeMethod

# Classes whose attention calls ALL_ATTENTION_FUNCTIONS although the flag is not set upstream
# (checked in transformers 5.17-5.24; greedy parity in tests/shard/test_transformers_backend.py).
INTERFACE_WITHOUT_FLAG = frozenset({"stablelm"})
# Config fields that make decode steps sync with the host inside transformers' code: MoE expert
# loops (`nonzero` over the routed experts) (soft-capped models: see declared_graph_safe).
_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


_LLAMA_PLAN = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


def tp_plan(config: Any) -> dict[str, str]:
    """The config's base_model_tp_plan; for StableLM (none upstream, Llama's module names) the
    Llama plan, with q/k/v replicated when its per-head q/k layer norms need every head."""
    text = config.get_text_config()
    plan = dict(getattr(text, "base_model_tp_plan", None) or {})
    if not plan and config.model_type == "stablelm":
        plan = dict(_LLAMA_PLAN)
        if getattr(text, "qk_layernorm", False):
            for proj in ("q_proj", "k_proj", "v_proj"):
                plan[f"layers.*.self_attn.{proj}"] = "colwise_gather_output"
            plan["layers.*.self_attn.o_proj"] = "rowwise_split_input"
    return _packed_pairs(plan)


def _packed_pairs(plan: dict[str, str]) -> dict[str, str]:
    """A packed gate/up projection that the plan replicates only because the model chunks it
    in two (Phi-3: `gate_up_proj` colwise_gather_output, `down_proj` rowwise_split_input) is
    split as two packed halves instead (PACKED: each rank keeps its share of gate and
    of up, so the chunk still pairs them), its down projection row-wise."""
    out = dict(plan)
    for pattern, style in plan.items():
        parent, _, leaf = pattern.rpartition(".")
        down = f"{parent}.down_proj"
        if (leaf == "gate_up_proj" and style == "colwise_gather_output"
                and plan.get(down) == "rowwise_split_input"):
            out[pattern], out[down] = PACKED, "rowwise"
    return out


# Vision-language model types served (transformers' image-text-to-text class) and the module
# path of their language model, whose projections the tp plan names (greedy parity with images:
# tests/shard/test_vision_backend.py). The vision tower and projector run as transformers wrote
# them (sdpa attention), on every rank.
VISION_MODELS: dict[str, str] = {"llava": "model.language_model", **MROPE_MODELS,
                                 **TILED_MODELS}


@dataclass(frozen=True)
class BackendClass:
    """The transformers class the backend builds for a config, and how."""

    cls: type
    # The attention implementation: ours for the language model; a VLM's vision tower keeps sdpa.
    attn_implementation: str | dict[str, str]
    base_prefix: str | None  # the language model's module path; None: cls.base_model_prefix
    vision: bool  # takes images (VisionLM)


def backend_class(config: Any, attn_implementation: str) -> BackendClass:
    """The class for the config (a causal LM, or a listed vision-language model); ValueError
    naming the model type and why it cannot be served."""
    import torch
    import transformers

    model_type = config.model_type
    if model_type not in VISION_MODELS:
        return BackendClass(causal_lm_class(config, attn_implementation), attn_implementation,
                            None, False)
    cls = transformers.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    impl = {"": "sdpa", "text_config": attn_implementation, "vision_config": "sdpa"}
    with torch.device("meta"):  # structure only: no memory, no weights
        skeleton = cls._from_config(config, attn_implementation=impl)
    attention_modules(skeleton, model_type)  # the language model's layers (the vision
    # tower's attention modules carry no layer_idx)
    return BackendClass(cls, impl, VISION_MODELS[model_type], True)


def unsupported(model_type: str, why: str) -> ValueError:
    return ValueError(f"model_type {model_type!r} cannot be served by the transformers backend: "
                      f"{why}")


def causal_lm_class(config: Any, attn_implementation: str) -> type:
    """transformers' causal-LM class for the config; ValueError naming the model type and why
    it cannot be served (checked on a weightless instance before any weight is read)."""
    import torch
    import transformers

    model_type = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise unsupported(model_type, "encoder-decoder models are not served (decoder-only only)")
    mapping = transformers.MODEL_FOR_CAUSAL_LM_MAPPING
    if type(config) not in mapping:
        raise unsupported(model_type, f"transformers {transformers.__version__} has no causal "
                          "language model class for it")
    cls = mapping[type(config)]
    if not (cls.is_backend_compatible() or model_type in INTERFACE_WITHOUT_FLAG):
        raise unsupported(model_type, f"{cls.__name__} does not route attention through "
                          "transformers' attention interface (no _supports_attention_backend)")
    with torch.device("meta"):  # structure only: no memory, no weights
        skeleton = cls._from_config(config, attn_implementation=attn_implementation)
    attention_modules(skeleton, model_type)
    return cls


def attention_modules(model: nn.Module, model_type: str) -> list[nn.Module]:
    """The modules that call the attention interface, in layer order (transformers names them
    *Attention and numbers them with layer_idx); ValueError for non-causal attention."""
    found = [m for m in model.modules()
             if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
    if not found:
        raise unsupported(model_type, "no attention layers with a layer index found")
    if any(getattr(m, "is_causal", True) is False for m in found):
        raise unsupported(model_type, "its attention is not causal (bidirectional layers)")
    return sorted(found, key=lambda m: m.layer_idx)


def declared_graph_safe(config: Any, quant: LinearQuantization | None) -> bool:
    """Whether decode steps may be captured in CUDA graphs: declared from the config, never
    probed. MoE layers sync with the host; bitsandbytes' int8 outlier path too. Soft-capped
    attention now goes through the backend's kernels (no host lengths) but stays eager here
    until the backend's graphs are checked on a GPU with a soft-capped model (the native Gemma
    path captures them). M-RoPE models (Qwen2-VL) capture: a decode row's position is
    index + rope_delta on all three sections, a 1-D position the model repeats per section
    (prompt rows with 3-D positions run eagerly; tests/gpu/test_vision_cuda.py)."""
    text = config.get_text_config()
    if any((getattr(text, f, None) or 0) > 0 for f in _MOE_FIELDS):
        return False
    if getattr(text, "attn_logit_softcapping", None):
        return False
    return quant is None or quant.flag not in (
        QuantizeMethod.BITSANDBYTES, QuantizeMethod.BITSANDBYTES_NF4
    )
