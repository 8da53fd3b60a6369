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


def tiny_model(
    tmp_path_factory: pytest.TempPathFactory, arch: str = "llama", train_steps: int = 0
) -> Path:
    """A tiny model (random weights, or trained for `train_steps` on the progression task of
    shard/tiny_training.py), built at most once per test session: it is cached under the
    session's base temp directory, so every fixture and test that asks for the same
    (arch, train_steps) shares one directory (a training run costs ~5 s)."""
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model

    out = tmp_path_factory.getbasetemp() / "tiny-models" / f"{arch}-{train_steps}"
    if not out.exists():
        # Built aside and renamed in one step: a failed build never leaves a half model behind.
        scratch = tmp_path_factory.mktemp(f"building-{arch}") / "model"
        make_tiny_model(scratch, TinyModelSpec(arch=arch, train_steps=train_steps))
        out.parent.mkdir(exist_ok=True)
        scratch.rename(out)
    return out


def trained_tiny_model(
    tmp_path_factory: pytest.TempPathFactory, arch: str = "llama", steps: int | None = None
) -> Path:
    """tiny_model trained for `steps` (default: shard.tools.tiny_training.RECOMMENDED_STEPS)."""
    from shard.tools.tiny_training import RECOMMENDED_STEPS

    return tiny_model(tmp_path_factory, arch, RECOMMENDED_STEPS if steps is None else steps)
