"""GGUF files for tests, written with the `gguf` package's GGUFWriter from a tiny model's tensors
(transformers reads GGUF but cannot write it).

qwen2 and llama are written; llama.cpp stores llama's q/k projections with their rotary halves
interleaved (transformers un-permutes them on load), which write_gguf replicates; qwen2's tensors
are stored as in the HF checkpoint. Linears may be written quantized (write_gguf's linear_types).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

ARCH = gguf.MODEL_ARCH.QWEN2
ARCH_NAME = gguf.MODEL_ARCH_NAMES[ARCH]


def write_qwen2_gguf(model_dir: Path, out: Path) -> Path:
    """Writes the tiny qwen2 model in model_dir (`tokenwire make-tiny-model --arch qwen2`) as
    GGUF file `out`, every tensor float32, tokenizer and chat template in the metadata."""
    return write_gguf(model_dir, out, ARCH)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert script stores llama's q/k rows with each head's rotary halves
    interleaved (its `permute`: rows [head, 2, d/2] read as [head, d/2, 2]); transformers' GGUF
    loader undoes it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2
                                                                                 ).reshape(w.shape)


def random_k_blocks(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int
                    ) -> np.ndarray:
    """[rows, bytes] of valid Q4_K / Q6_K blocks (the gguf package has no K-quant quantizer):
    random integers and sub-block scales under block scales that keep weights about +-0.05;
    gguf's own dequantizer then says what they hold. Block layouts from ggml's block_q4_K
    (d, dmin fp16, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles) and block_q6_K (128 +
    64 bytes of low/high bits, 16 int8 scales, d fp16 last)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    n = blocks.shape[0]
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        blocks[:, 0:2] = np.full((n, 1), 1e-4, np.float16).view(np.uint8)  # d
        blocks[:, 2:4] = np.full((n, 1), 7e-4, np.float16).view(np.uint8)  # dmin
    else:
        blocks[:, 208:210] = np.full((n, 1), 1e-5, np.float16).view(np.uint8)  # d
    return blocks.reshape(rows, -1)


def write_gguf(model_dir: Path, out: Path, arch: gguf.MODEL_ARCH,
               linear_types: dict[str, gguf.GGMLQuantizationType] | None = None) -> Path:
    """Writes the tiny model in model_dir as GGUF file `out` (tokenizer and chat template in the
    metadata). linear_types: HF tensor name -> the type its data is written in (gguf's own
    quantizer for Q8_0 / Q4_0 / Q4_1 / Q5_0 and the other types it implements, random valid
    blocks for Q4_K / Q6_K); every other tensor float32. llama's q/k rows are permuted as
    llama.cpp writes them."""
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    linear_types = linear_types or {}
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    layers = config["num_hidden_layers"]

    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), arch_name)
    writer.add_name(f"tiny-{arch_name}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if not linear_types
                         else gguf.LlamaFileType.MOSTLY_Q4_1)

    # Byte-level BPE as llama.cpp writes it for gpt2-style tokenizers: tokens in id order, their
    # types (special tokens are CONTROL), the merges as "a b" strings.
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in tokenizer["added_tokens"] if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == ARCH else "default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_chat_template(tokenizer_config["chat_template"])

    names = gguf.get_tensor_name_map(arch, layers)
    for i, (name, tensor) in enumerate(sorted(load_file(str(model_dir / "model.safetensors")).items())):
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(f"no GGUF name for {name}")
        data = np.ascontiguousarray(tensor, dtype=np.float32)
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            data = llama_cpp_permute(data, heads)
        qtype = linear_types.get(name)
        if qtype is None:
            writer.add_tensor(gguf_name, data)
        elif qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
            writer.add_tensor(gguf_name, random_k_blocks(qtype, *data.shape, seed=i),
                              raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


T = gguf.GGMLQuantizationType
# Every type kept packed, on several kinds of linear; layer 1's gate_proj in Q5_0 (a type that
# still dequantizes).
PACKED_LLAMA_TYPES = {
    "model.layers.0.self_attn.q_proj.weight": T.Q8_0,
    "model.layers.0.self_attn.k_proj.weight": T.Q4_0,
    "model.layers.0.self_attn.v_proj.weight": T.Q4_1,
    "model.layers.0.self_attn.o_proj.weight": T.Q4_K,
    "model.layers.0.mlp.gate_proj.weight": T.Q6_K,
    "model.layers.0.mlp.up_proj.weight": T.Q4_1,
    "model.layers.0.mlp.down_proj.weight": T.Q4_K,
    "model.layers.1.self_attn.q_proj.weight": T.Q4_K,
    "model.layers.1.self_attn.k_proj.weight": T.Q6_K,
    "model.layers.1.self_attn.v_proj.weight": T.Q8_0,
    "model.layers.1.self_attn.o_proj.weight": T.Q4_0,
    "model.layers.1.mlp.gate_proj.weight": T.Q5_0,
    "model.layers.1.mlp.up_proj.weight": T.Q4_1,
    "model.layers.1.mlp.down_proj.weight": T.Q4_1,
}


@dataclass
class PackedGgufLlama:
    file: Path  # the GGUF file
    packed: Path  # its snapshot with the linears kept quantized
    plain: Path  # its dequantized snapshot
    log: list[str] = field(default_factory=list)  # the packed conversion's lines


def packed_gguf_llama(root: Path) -> PackedGgufLlama:
    """A tiny llama (hidden 256, intermediate 512: K-quants need rows of 256; head dim 64, GQA
    4/2) written as GGUF with PACKED_LLAMA_TYPES, converted both ways into root / "cache"."""
    from shard.tools.gguf import ensure_snapshot
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model

    model = make_tiny_model(root / "model", TinyModelSpec(arch="llama", hidden_size=256,
                                                          intermediate_size=512))
    file = write_gguf(model, root / "files" / "tiny-llama.gguf", gguf.MODEL_ARCH.LLAMA,
                      PACKED_LLAMA_TYPES)
    log: list[str] = []
    packed = ensure_snapshot(file, root / "cache", log=log.append, packed=True).path
    plain = ensure_snapshot(file, root / "cache", log=lambda _: None).path
    return PackedGgufLlama(file, packed, plain, log)
