"""Tiny random checkpoints of any transformers decoder architecture for the transformers
backend's tests (shard/tools/tiny_any.py), built once per test session per model type."""

from __future__ import annotations

from pathlib import Path

import pytest

from shard.tools.tiny_any import OVERRIDES, write_tiny_any

__all__ = ["OVERRIDES", "hf_model"]


def hf_model(tmp_path_factory: pytest.TempPathFactory, model_type: str) -> Path:
    """write_tiny_any, at most once per test session per model type (shared directory)."""
    out = tmp_path_factory.getbasetemp() / "hf-models" / model_type
    if not out.exists():
        scratch = tmp_path_factory.mktemp(f"building-{model_type}") / "model"
        write_tiny_any(scratch, model_type)
        out.parent.mkdir(exist_ok=True)
        scratch.rename(out)
    return out
