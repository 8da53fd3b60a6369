"""tokenwire's RMSNorm (one fused kernel on CUDA instead of ~7) in place of transformers'
Llama-style RMSNorm modules.

Only the classes listed in LLAMA_STYLE_RMS_NORMS are swapped: their forward is Llama's to the
letter (variance in float32, normalized value cast back to the input dtype, then times the
weight), which is what tokenwire's RMSNorm computes; tests/shard/test_transformers_backend.py
checks that their source still equals LlamaRMSNorm's. Others (Gemma's 1 + weight, OLMo 2's
weight before the cast, Cohere's layer norm) keep transformers' module.
"""

from __future__ import annotations

import torch
from torch import nn

from shard.layers.norm import RMSNorm

LLAMA_STYLE_RMS_NORMS = frozenset({
    "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "GraniteRMSNorm",
    "MixtralRMSNorm", "Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm",
})


class RowsRMSNorm(RMSNorm):
    """RMSNorm over the last dim of any leading shape ([1, tokens, hidden], [1, tokens, heads,
    head_dim] for q/k norms): the fused kernel takes [rows, dim]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.reshape(-1, x.shape[-1])).view(x.shape)


def swap_rms_norms(model: nn.Module) -> int:
    """Replaces every listed RMSNorm module of `model` (same weight tensor, same epsilon);
    returns how many."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if type(module).__name__ not in LLAMA_STYLE_RMS_NORMS:
            continue
        new = RowsRMSNorm(module.weight.shape[0], module.variance_epsilon)
        new.weight = module.weight
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
        swapped += 1
    return swapped
