"""Tiny model and tokenizer directories for tests (built locally; no hub)."""

from __future__ import annotations

from pathlib import Path

import pytest


def write_tokenizer_dir(out_dir: Path, vocab_size: int = 512) -> Path:
    """Writes only tokenizer.json (no torch import): enough for validation and tokenization."""
    from shard.tools.tiny_model import build_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(vocab_size).save(str(out_dir / "tokenizer.json"))
    return out_dir


def write_tiny_model(out_dir: Path, arch: str = "llama", **spec: int) -> Path:
    """Writes a tiny model (config, safetensors, tokenizer) into out_dir; random weights unless
    spec sets train_steps."""
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model

    return make_tiny_model(out_dir, TinyModelSpec(arch=arch, **spec))


def trained_tiny_model(
    tmp_path_factory: pytest.TempPathFactory, arch: str = "llama", steps: int | None = None
) -> Path:
    """A tiny model trained on the progression task (shard/tools/tiny_training.py), built at most once
    per test session: it is cached under the session's base temp directory, so every fixture
    and test that asks for the same (arch, steps) shares one training run (~5 s each)."""
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model
    from shard.tools.tiny_training import RECOMMENDED_STEPS

    steps = RECOMMENDED_STEPS if steps is None else steps
    out = tmp_path_factory.getbasetemp() / "trained-tiny" / f"{arch}-{steps}"
    if not out.exists():
        # Built aside and renamed in one step: a failed build never leaves a half model behind.
        scratch = tmp_path_factory.mktemp(f"training-{arch}") / "model"
        make_tiny_model(scratch, TinyModelSpec(arch=arch, train_steps=steps))
        out.parent.mkdir(exist_ok=True)
        scratch.rename(out)
    return out
