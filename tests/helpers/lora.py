"""LoRA adapters for tests, written by `peft` itself (the format users bring), with random
weights large enough to change greedy output; and `transformers` + `peft` (PeftModel, unmerged)
as the reference."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load_base(model_dir: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


def write_adapter(
    model_dir: Path,
    out_dir: Path,
    *,
    r: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = ALL_TARGETS,
    seed: int = 0,
    std: float = 0.2,
    use_rslora: bool = False,
    base=None,
) -> Path:
    """A PEFT LoRA adapter for the model in `model_dir` with every A and B drawn from
    N(0, std^2) (seeded), saved with `save_pretrained` (adapter_config.json +
    adapter_model.safetensors)."""
    import peft

    base = base if base is not None else load_base(model_dir)
    config = peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
        use_rslora=use_rslora, bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(str(out_dir))
    model.unload()  # leaves `base` as it was (the adapter layers removed)
    return out_dir


@torch.inference_mode()
def peft_greedy(
    model_dir: Path, adapter_dir: Path | None, prompt: list[int], n: int, base=None
) -> list[int]:
    """Greedy generation of n tokens (EOS off) by transformers + PeftModel (unmerged). `base`:
    an already loaded base model to wrap (left as it was afterwards)."""
    import transformers

    model = base if base is not None else load_base(model_dir)
    if adapter_dir is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    config = transformers.GenerationConfig(
        max_new_tokens=n, min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    try:
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
        )
    finally:
        if adapter_dir is not None:
            model.unload()  # the base's own layers back in place
    return out[0, len(prompt) :].tolist()
