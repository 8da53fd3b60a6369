"""transformers reference outputs for the shard tests."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf(model_dir: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """generate() greedy, n new tokens, EOS disabled so that exactly n come out."""
    import transformers

    config = transformers.GenerationConfig(
        max_new_tokens=n, min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    # transformers 5.x fills unset fields of `config` from the model's own generation config,
    # whose eos_token_id would then stop generation early: unset there too, for this call.
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
        )
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt) :].tolist()


def prompts(model_dir: Path, lengths: list[int]) -> list[list[int]]:
    """Prompts of the given token lengths cut from a real text."""
    import tokenizers

    from shard.tools.tiny_model import CORPUS

    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(" ".join(CORPUS * 3)).ids
    out, offset = [], 0
    for n in lengths:
        out.append(ids[offset : offset + n])
        offset += 7
    return out
