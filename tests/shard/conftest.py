"""Shared fixtures of the shard tests: tiny models built once per session, a transformers
reference, and a small driver that plays the router (allocates blocks, grants them)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers.models import tiny_model, trained_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    return {
        arch: tiny_model(tmp_path_factory, arch) for arch in ("llama", "mistral", "qwen2", "gpt2")
    }


@pytest.fixture(scope="session")
def trained_tiny_models(tmp_path_factory) -> Callable[[str], Path]:
    """arch -> a tiny model trained on the progression task (confident greedy choices), each
    built on first use only: training costs ~5 s per architecture."""
    return lambda arch: trained_tiny_model(tmp_path_factory, arch)
