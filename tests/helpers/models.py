"""Tiny model and tokenizer directories for tests (built locally; no hub)."""

from __future__ import annotations

import fcntl
import os
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
    shard/tiny_training.py), built at most once per test run: it is cached under the session's
    base temp directory, so every fixture and test that asks for the same (arch, train_steps)
    shares one directory (a training run costs ~5-10 s of CPU). Under pytest-xdist the cache is
    the run's directory above the workers' own base temps, and a lock per model makes a worker
    wait for another's build and reuse it (the build is deterministic, so either is the same)."""
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out = root / "tiny-models" / f"{arch}-{train_steps}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / f".{arch}-{train_steps}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not out.exists():
            # Built aside and renamed in one step: a failed build never leaves a half model.
            scratch = tmp_path_factory.mktemp(f"building-{arch}") / "model"
            make_tiny_model(scratch, TinyModelSpec(arch=arch, train_steps=train_steps))
            scratch.rename(out)
    return out


def trained_tiny_model(
    tmp_path_factory: pytest.TempPathFactory, arch: str = "llama", steps: int | None = None
) -> Path:
    """tiny_model trained for `steps` (default: shard.tools.tiny_training.RECOMMENDED_STEPS)."""
    from shard.tools.tiny_training import RECOMMENDED_STEPS

    return tiny_model(tmp_path_factory, arch, RECOMMENDED_STEPS if steps is None else steps)
