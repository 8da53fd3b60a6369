"""Tiny random Gemma 2 / Gemma 3 text checkpoints whose every Gemma option changes the output
(tests/shard/test_gemma.py, tests/gpu/test_gemma_cuda.py): norm weights random (the (1 + w)
offset and its rounding), a sliding window of 6 that every test prompt crosses, local and global
layers with different rotary bases (Gemma 3: scaled global rotary), an attention soft-cap small
enough to bind (Gemma 2), query_pre_attn_scalar unlike head_dim, a final-logit soft-cap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shard.models.layer_types import FULL, SLIDING
from shard.tools.tiny_any import write_tiny_any

WINDOW = 6
# What the tiny models set beyond tiny_any's common shape (2 layers there; 3 here so that Gemma 3
# has local, global, local).
GEMMA_CONFIGS: dict[str, dict[str, Any]] = {
    "gemma2": {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": WINDOW,
               "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
               "final_logit_softcapping": 3.0},
    "gemma3_text": {
        "head_dim": 16, "num_hidden_layers": 3, "sliding_window": WINDOW,
        "query_pre_attn_scalar": 24, "final_logit_softcapping": 3.0,
        "layer_types": [SLIDING, FULL, SLIDING],
        "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 10.0},
                            FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0}},
    },
}


def gemma_model(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    """The tiny `arch` model, written at most once per test session."""
    out = tmp_path_factory.getbasetemp() / "gemma-models" / arch
    if not out.exists():
        scratch = tmp_path_factory.mktemp(f"building-{arch}") / "model"
        write_tiny_any(scratch, arch, randomize_norms=True, **GEMMA_CONFIGS[arch])
        out.parent.mkdir(exist_ok=True)
        scratch.rename(out)
    return out
