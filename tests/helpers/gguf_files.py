"""GGUF files for tests, written with the `gguf` package's GGUFWriter from a tiny model's tensors
(transformers reads GGUF but cannot write it).

Only qwen2 is written: llama.cpp stores llama's q/k projections with their rotary halves
interleaved (transformers un-permutes them on load), which a faithful writer would have to
replicate; qwen2's tensors are stored as in the HF checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

ARCH = gguf.MODEL_ARCH.QWEN2
ARCH_NAME = gguf.MODEL_ARCH_NAMES[ARCH]


def write_qwen2_gguf(model_dir: Path, out: Path) -> Path:
    """Writes the tiny qwen2 model in model_dir (`tokenwire make-tiny-model --arch qwen2`) as
    GGUF file `out`, every tensor float32, tokenizer and chat template in the metadata."""
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    layers = config["num_hidden_layers"]

    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), ARCH_NAME)
    writer.add_name("tiny-qwen2")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    # Byte-level BPE as llama.cpp writes it for gpt2-style tokenizers: tokens in id order, their
    # types (special tokens are CONTROL), the merges as "a b" strings.
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in tokenizer["added_tokens"] if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_chat_template(tokenizer_config["chat_template"])

    names = gguf.get_tensor_name_map(ARCH, layers)
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(f"no GGUF name for {name}")
        writer.add_tensor(gguf_name, np.ascontiguousarray(tensor, dtype=np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
