"""Tiny model and tokenizer directories for tests (built locally; no hub)."""

from __future__ import annotations

from pathlib import Path


def write_tokenizer_dir(out_dir: Path, vocab_size: int = 512) -> Path:
    """Writes only tokenizer.json (no torch import): enough for validation and tokenization."""
    from shard.tiny_model import build_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(vocab_size).save(str(out_dir / "tokenizer.json"))
    return out_dir


def write_tiny_model(out_dir: Path, arch: str = "llama", **spec: int) -> Path:
    """Writes a tiny random-weight model (config, safetensors, tokenizer) into out_dir."""
    from shard.tiny_model import TinyModelSpec, make_tiny_model

    return make_tiny_model(out_dir, TinyModelSpec(arch=arch, **spec))
