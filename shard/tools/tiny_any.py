"""Tiny random checkpoints of any transformers decoder architecture, laid out like a hub
snapshot: 2 layers, hidden 64, 4 query / 2 KV heads, the tiny byte-level BPE tokenizer of
shard/tools/tiny_model.py. For the transformers backend's parity tests and its context-length
benchmark (benchmarks/transformers_backend_context.py); random weights with a wide initializer
so that greedy choices are clear."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Per model type: what differs from the common shape (head_dim where the config's default is
# large, MoE sizes, small sliding windows that test prompts cross, soft-capping kept on).
OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {},
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "sliding_window": 24, "query_pre_attn_scalar": 16,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "qwen3": {"head_dim": 16},
    "phi3": {},
    "olmo2": {},
    "granite": {"embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                "attention_multiplier": 0.3, "logits_scaling": 2.0},
    "starcoder2": {"sliding_window": 24},
    "stablelm": {},
    "cohere": {"logit_scale": 0.5},
    "gpt_neox": {"num_key_value_heads": None},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1},
    "olmo": {},
    "phi": {},
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32},
}


def write_tiny_any(out: Path, model_type: str, seed: int = 0, randomize_norms: bool = False,
                   **extra: Any) -> Path:
    """Writes a tiny random `model_type` checkpoint and the tiny tokenizer into `out`.
    randomize_norms: every norm weight random too (transformers initializes them to ones, or
    zeros for Gemma's 1 + w, under which a wrong offset or rounding order would not show)."""
    import torch
    import transformers

    from shard.tools.tiny_model import BOS, EOS, PAD, build_tokenizer

    tokenizer = build_tokenizer(512)
    special = {t: tokenizer.token_to_id(t) for t in (BOS, EOS, PAD)}
    kw: dict[str, Any] = {
        "vocab_size": tokenizer.get_vocab_size(), "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "max_position_embeddings": 4096, "initializer_range": 0.1,
        "bos_token_id": special[BOS], "eos_token_id": special[EOS], "pad_token_id": special[PAD],
        "tie_word_embeddings": False,
    }
    kw.update(OVERRIDES.get(model_type, {}))
    kw.update(extra)
    kw = {k: v for k, v in kw.items() if v is not None}
    config = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if randomize_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name.rsplit(".", 2)[-2]:
                    param.normal_(0.0, 0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
         "pad_token": PAD}) + "\n")
    return out
