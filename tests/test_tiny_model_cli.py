"""`tokenwire make-tiny-model` writes a hub-like snapshot that transformers loads and generates
with, deterministically per seed."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers


def make(out: Path, arch: str, seed: int = 0) -> Path:
    subprocess.run(
        [sys.executable, "-m", "service.cli", "make-tiny-model", str(out), "--arch", arch,
         "--seed", str(seed)],
        check=True, capture_output=True, timeout=120,
    )
    return out


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gpt2"])
def test_cli_output_loads_in_transformers_and_generates(tmp_path: Path, arch: str) -> None:
    model_dir = make(tmp_path / arch, arch)
    files = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= files
    assert sum(p.stat().st_size for p in model_dir.iterdir()) < 4 * 2**20  # a few MB at most
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == arch

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"
    assert tokenizer.chat_template  # clients exercising chat formatting find one
    inputs = tokenizer("Testing API caf\u00e9", return_tensors="pt")
    assert inputs.input_ids[0, 0].item() == tokenizer.bos_token_id
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == inputs.input_ids.shape[1] + 8 or out[0, -1] == tokenizer.eos_token_id
    # Byte-level BPE: any text round-trips, multi-byte characters included.
    text = "caf\u00e9 \u65e5\u672c \U0001f680"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text


def test_same_seed_same_weights_other_seed_other_weights(tmp_path: Path) -> None:
    def digest(path: Path) -> str:
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    a = digest(make(tmp_path / "a", "llama", seed=1))
    b = digest(make(tmp_path / "b", "llama", seed=1))
    c = digest(make(tmp_path / "c", "llama", seed=2))
    assert a == b != c
