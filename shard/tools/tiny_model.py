"""`tokenwire make-tiny-model`: deterministic tiny models laid out like a hub snapshot.

Tests and the embedded default model need real checkpoints without a model hub: this writes
config.json, generation_config.json, model.safetensors and a real byte-level BPE tokenizer
(tokenizer.json + tokenizer_config.json with BOS/EOS and a chat template) that
`transformers.AutoModelForCausalLM` / `AutoTokenizer` load as they would a downloaded model.
Weights are random unless `--train-steps N` fits them to a synthetic task (shard/tools/tiny_training.py),
which gives the confident predictions that exact greedy comparisons need.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

ARCHITECTURES = ("llama", "mistral", "qwen2", "gpt2")
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# Jinja chat template in the common "role: content" shape; the model is random, the template is
# there so that clients exercising chat formatting find one.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
# Training text for the tokenizer's merges: English with digits, punctuation and multi-byte
# characters so that incremental detokenization meets tokens that split UTF-8 sequences.
CORPUS = [
    "The quick brown fox jumps over the lazy dog while the router batches requests.",
    "Testing API: generate text, stream tokens, and report details for every request.",
    "Paged attention keeps keys and values in fixed-size blocks of sixteen tokens each.",
    "In 2024, 1,000 requests arrived at 40 requests per second; latency stayed under 50 ms.",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve fa\u00e7ade, \u00fcber stra\u00dfe.",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u4e2d\u6587\u6587\u672c, emoji \U0001f680\U0001f525\u2728.",
    "def generate(prompt: str, max_new_tokens: int = 20) -> str: return model(prompt)",
    "Once upon a time there was a small model that answered every question with care.",
]


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny model; small enough for CI, large enough to exercise GQA and paging."""

    arch: str
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 1024
    # Mistral only: small enough that test prompts plus generation cross it.
    sliding_window: int = 48
    seed: int = 0
    # 0: random weights (the bytes tests have always had); N: N steps on the tiny task.
    train_steps: int = 0


def build_tokenizer(vocab_size: int):
    """Trains a byte-level BPE tokenizer on CORPUS (deterministic) and returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def build_config(spec: TinyModelSpec, vocab_size: int, special: dict[str, int]):
    """Returns a transformers config for the architecture, with the tokenizer's special ids."""
    import transformers

    common = {
        "vocab_size": vocab_size,
        "bos_token_id": special[BOS],
        "eos_token_id": special[EOS],
        "pad_token_id": special[PAD],
        # Larger than the usual 0.02 so that random logits are peaked: greedy comparisons against
        # the reference then do not hinge on near-ties.
        "initializer_range": 0.1,
    }
    if spec.arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=spec.hidden_size,
            n_layer=spec.num_layers,
            n_head=spec.num_heads,
            n_positions=spec.max_position_embeddings,
            **common,
        )
    llama_like = dict(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        **common,
    )
    if spec.arch == "llama":
        # Llama 3.1-style RoPE scaling, so the "llama3" rope_type is exercised by tests.
        return transformers.LlamaConfig(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
            **llama_like,
        )
    if spec.arch == "mistral":
        return transformers.MistralConfig(sliding_window=spec.sliding_window, **llama_like)
    if spec.arch == "qwen2":
        # Qwen2 has q/k/v biases; tied embeddings as in the small Qwen2 checkpoints.
        return transformers.Qwen2Config(tie_word_embeddings=True, **llama_like)
    raise ValueError(f"--arch must be one of {', '.join(ARCHITECTURES)}; got {spec.arch!r}")


def make_tiny_model(out_dir: Path | str, spec: TinyModelSpec) -> Path:
    """Writes the model and tokenizer to out_dir (created) and returns it."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size)
    special = {tok: tokenizer.token_to_id(tok) for tok in (BOS, EOS, PAD)}
    config = build_config(spec, tokenizer.get_vocab_size(), special)
    torch.manual_seed(spec.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=special[BOS], eos_token_id=special[EOS], pad_token_id=special[PAD]
    )
    final_loss = None
    if spec.train_steps > 0:
        from shard.tools.tiny_training import train_tiny_model

        final_loss = train_tiny_model(model, spec.train_steps, seed=spec.seed)
    model.save_pretrained(out, safe_serialization=True)
    if final_loss is not None:
        from shard.tools.tiny_training import write_task_card

        write_task_card(out, spec.train_steps, spec.seed, final_loss)

    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n"
    )
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", type=Path, help="directory to write the model into")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="llama")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    parser.add_argument(
        "--train-steps", type=int, default=0, metavar="N",
        help="train N steps on the synthetic progression task (CPU, deterministic; 200 gives "
        "confident greedy choices in ~5 s); 0 keeps random weights",
    )


def run(args: argparse.Namespace) -> int:
    if args.train_steps < 0:
        raise SystemExit(f"--train-steps must be >= 0; got {args.train_steps}")
    spec = TinyModelSpec(arch=args.arch, seed=args.seed, train_steps=args.train_steps)
    path = make_tiny_model(args.out_dir, spec)
    trained = f" trained {args.train_steps} steps" if args.train_steps else ""
    print(f"wrote tiny {args.arch} model{trained} to {path}")
    return 0
