"""Shared fixtures of the shard tests: tiny models built once per session, a transformers
reference, and a small driver that plays the router (allocates blocks, grants them)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers.gguf_files import PackedGgufLlama, packed_gguf_llama
from tests.helpers.int_checkpoints import IntSpec, write_int_checkpoint
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


@pytest.fixture(scope="session")
def gguf_llama(tmp_path_factory) -> PackedGgufLlama:
    """A tiny llama GGUF file with every packed type, and its packed and float snapshots
    (test_gguf_packed.py, test_int_two_ranks.py)."""
    return packed_gguf_llama(tmp_path_factory.mktemp("gguf-packed"))


@pytest.fixture(scope="session")
def w8a8_checkpoint(trained_tiny_models, tmp_path_factory) -> tuple[Path, Path]:
    """(a compressed-tensors int-quantized W8A8 tiny trained llama, its dequantized float32
    reference) (test_w8a8.py, test_int_two_ranks.py)."""
    root = tmp_path_factory.mktemp("w8a8")
    spec = IntSpec("w8a8", 8, -1, sym=True)
    return root / "w8a8", write_int_checkpoint(trained_tiny_models("llama"), root / "w8a8", spec)
