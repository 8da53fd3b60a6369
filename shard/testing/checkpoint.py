"""Llama-3-8B-shaped (or Qwen3-8B- or Gemma-2-9B-shaped) random checkpoints (bf16 safetensors
written on the GPU, tensor by tensor) with a word-level tokenizer of the same vocabulary size: the
benchmark harness's model and the GPU tests' large-shape model.

lm_head's rows of the EOS tokens are zero, so greedy decoding never picks EOS (logit 0 against
the positive maximum of 128k random logits) and every request generates exactly max_new_tokens.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

LLAMA3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
}
# Qwen3-8B (model_type qwen3): per-head q/k norms, head_dim 128, 36 layers, a 151,936 vocabulary.
QWEN3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
}
# Gemma-2-9B (google/gemma-2-9b's config): head_dim 256 over 16 query / 8 KV heads (so
# heads * head_dim != hidden), sandwich norms, GELU-tanh MLP, every other layer local (window
# 4096), soft-capped attention (50) and logits (30), tied embeddings.
GEMMA2_9B = {
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "num_hidden_layers": 42,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "vocab_size": 256000,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "hidden_activation": "gelu_pytorch_tanh",
}
# model_type -> (shape, architecture, checkpoint directory stem)
SHAPES = {"llama": (LLAMA3_8B, "LlamaForCausalLM", "llama3-8b-shape"),
          "qwen3": (QWEN3_8B, "Qwen3ForCausalLM", "qwen3-8b-shape"),
          "gemma2": (GEMMA2_9B, "Gemma2ForCausalLM", "gemma2-9b-shape")}
BOS_ID, EOS_ID = 128000, 128001
EOS_IDS = (128001, 128008, 128009)


def write_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """Word-level tokenizer: "t0".."t127999" plus Llama-3's special tokens at 128000+.
    Whitespace-separated words map 1:1 to tokens, so prompt lengths are exact."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = {BOS_ID: "<|begin_of_text|>", EOS_ID: "<|end_of_text|>",
                128008: "<|eom_id|>", 128009: "<|eot_id|>"}
    vocab = {f"t{i}": i for i in range(BOS_ID)}
    for i in range(BOS_ID, vocab_size):
        vocab[specials.get(i, f"<|reserved_special_token_{i - BOS_ID}|>")] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|reserved_special_token_2|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(s, special=True) for s in specials.values()])
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[BOS_ID],
        "eos_token": specials[EOS_ID], "model_max_length": 8192,
    }))


def write_checkpoint(model_dir: Path, num_layers: int, model_type: str = "llama") -> dict:
    """Random bf16 weights of SHAPES[model_type] (Llama-3-8B, Qwen3-8B or Gemma-2-9B) with
    num_layers layers, generated on the GPU and saved shard by shard. Gemma: tied embeddings
    (the embedding's EOS rows are zero), norm weights zero (it scales by 1 + w), four per layer."""
    import torch
    from safetensors.torch import save_file

    shape, arch, _ = SHAPES[model_type]
    cfg = dict(shape, num_hidden_layers=num_layers)
    model_dir.mkdir(parents=True, exist_ok=True)
    marker = model_dir / "complete.json"
    if marker.is_file() and json.loads(marker.read_text()).get("num_layers") == num_layers:
        return json.loads(marker.read_text())
    t0 = time.perf_counter()
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    gemma = model_type == "gemma2"
    # Norm weights that scale by 1: ones, or zeros under Gemma's (1 + w).
    norm = torch.zeros if gemma else torch.ones
    layer_norms = ("input_layernorm", "post_attention_layernorm") + (
        ("pre_feedforward_layernorm", "post_feedforward_layernorm") if gemma else ())
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        t.normal_(0.0, std, generator=gen)
        return t.cpu()

    def layer(i: int) -> dict:
        p = f"model.layers.{i}."
        norms = {} if model_type != "qwen3" else {  # per-head q/k RMSNorm weights [head_dim]
            p + "self_attn.q_norm.weight": 1 + rnd(hd, std=0.1),
            p + "self_attn.k_norm.weight": 1 + rnd(hd, std=0.1),
        }
        return {**norms,
            p + "self_attn.q_proj.weight": rnd(heads * hd, h),
            p + "self_attn.k_proj.weight": rnd(kvh * hd, h),
            p + "self_attn.v_proj.weight": rnd(kvh * hd, h),
            p + "self_attn.o_proj.weight": rnd(h, heads * hd),
            p + "mlp.gate_proj.weight": rnd(inter, h),
            p + "mlp.up_proj.weight": rnd(inter, h),
            p + "mlp.down_proj.weight": rnd(h, inter),
            **{f"{p}{n}.weight": norm(h, dtype=torch.bfloat16) for n in layer_norms},
        }

    groups: list[dict] = []
    embed = rnd(v, h)
    if gemma:  # tied: the embedding is the LM head, whose EOS rows are zero
        embed[list(EOS_IDS)] = 0
    first = {"model.embed_tokens.weight": embed}
    groups.append(first)
    per_file = 8
    for start in range(0, num_layers, per_file):
        g: dict = {}
        for i in range(start, min(start + per_file, num_layers)):
            g.update(layer(i))
        groups.append(g)
    last = {"model.norm.weight": norm(h, dtype=torch.bfloat16)}
    if not gemma:
        lm_head = rnd(v, h)
        lm_head[list(EOS_IDS)] = 0  # greedy never selects EOS: fixed output lengths
        last["lm_head.weight"] = lm_head
    groups.append(last)
    weight_map, total = {}, 0
    for n, g in enumerate(groups):
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(g, str(model_dir / name), metadata={"format": "pt"})
        for k, t in g.items():
            weight_map[k] = name
            total += t.numel() * t.element_size()
        del g
    groups.clear()
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = {
        "architectures": [arch], "model_type": model_type, "torch_dtype": "bfloat16",
        "hidden_act": "gelu_pytorch_tanh" if gemma else "silu", "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": gemma, "bos_token_id": BOS_ID,
        "eos_token_id": list(EOS_IDS),
        "initializer_range": 0.02, "head_dim": hd, **cfg,
    }
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": list(EOS_IDS), "do_sample": False}))
    write_tokenizer(model_dir, v)
    info = {"num_layers": num_layers, "bytes": total, "seconds": time.perf_counter() - t0}
    marker.write_text(json.dumps(info))
    return info

