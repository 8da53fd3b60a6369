"""Fixtures shared by every test directory (keep them generic; helpers live in tests/helpers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.models import tiny_model, write_tokenizer_dir
from tests.helpers.ports import free_port
from tests.helpers.tools import check_needs_tool


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "needs_tool(available, reason): skips without the tool; fails under CI=true"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    check_needs_tool(item)


# The test files that take longest (from the suite's --durations on this 2-core machine, 30 s to
# 100 s each), run first: under `pytest -n 2 --dist loadfile` (make test) workers take files in
# collection order, and a long file started last leaves the other worker idle at the end.
LONGEST_FIRST = (
    "tests/shard/test_triton_gemv_interpreter.py",
    "tests/quality/test_smollm2.py",
    "tests/service/test_memory.py",
    "tests/e2e/test_structured.py",
    "tests/e2e/test_lora_smollm2.py",
    "tests/shard/test_gemma.py",
    "tests/shard/test_int_weights.py",
    "tests/shard/test_moe.py",
    "tests/shard/test_native_families.py",
    "tests/test_tiny_model_cli.py",
    "tests/test_install_sets.py",
    "tests/e2e/test_frontend_e2e.py",
    "tests/e2e/test_openai.py",
    "tests/e2e/test_gguf_launch.py",
    "tests/shard/test_transformers_backend.py",
    "tests/sdk/test_python_sdk.py",
    "tests/shard/test_triton_moe_interpreter.py",
    "tests/shard/test_quantization.py",
    "tests/shard/test_triton_decode_interpreter.py",
    "tests/shard/test_quantization_shard.py",
    "tests/e2e/test_scale_out.py",
    "tests/sdk/test_typescript_sdk.py",
    "tests/shard/test_triton_lora_interpreter.py",
    "tests/shard/test_triton_gemma_interpreter.py",
    "tests/shard/test_triton_int_gemv_interpreter.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """LONGEST_FIRST's files first, in that order; every other file keeps its place (a file's
    tests keep theirs: the sort is stable)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding only the tiny models' tokenizer.json (no torch needed)."""
    return write_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def wide_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word-level tokenizer covering the fake shard's whole vocabulary (token i reads " wi"),
    so the router's own detokenization (--router-detokenize) gives every fake token a text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from service.testing.fake_shard import VOCAB

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("wide-tokenizer")
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight llama model laid out like a hub snapshot (built once per session)."""
    return tiny_model(tmp_path_factory, "llama")


@pytest.fixture
def unused_port() -> int:
    """A free loopback TCP port."""
    return free_port()
