"""GGUF models (shard/tools/gguf.py): located from --model-id, converted once through transformers
into a cached snapshot equal to the tensors the file holds, reused afterwards; damaged files and
architectures tokenwire cannot serve fail with one line and leave nothing in the cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file

from shard.tools.tiny_model import TinyModelSpec, make_tiny_model
from shard.tools.gguf import (
    PROVENANCE,
    GGUFError,
    ensure_snapshot,
    locate_gguf,
    supported_model_types,
)
from tests.helpers.gguf_files import write_qwen2_gguf


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny qwen2 snapshot, the GGUF file written from its tensors)."""
    root = tmp_path_factory.mktemp("gguf")
    model = make_tiny_model(root / "model", TinyModelSpec(arch="qwen2"))
    return model, write_qwen2_gguf(model, root / "files" / "tiny-qwen2.gguf")


@pytest.fixture(scope="module")
def converted(tiny_qwen2: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    return ensure_snapshot(tiny_qwen2[1], tmp_path_factory.mktemp("cache"), log=lambda _: None)


def cache_entries(cache: Path) -> list[str]:
    root = cache / "gguf"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_every_supported_type_is_read_by_transformers_gguf() -> None:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    assert supported_model_types() == ["gemma2", "llama", "mistral", "phi3", "qwen2", "qwen3"]
    assert set(supported_model_types()) <= set(GGUF_CONFIG_MAPPING)


def test_locate(tiny_qwen2: tuple[Path, Path], tmp_path: Path) -> None:
    model, file = tiny_qwen2
    assert locate_gguf(str(file)) == file.resolve()
    assert locate_gguf(str(file.parent)) == file.resolve()  # a directory of one GGUF file
    assert locate_gguf(str(model)) is None  # an ordinary snapshot
    assert locate_gguf("org/name") is None  # a hub id without --gguf-file
    several = tmp_path / "several"
    several.mkdir()
    for name in ("a.Q4_0.gguf", "a.Q8_0.gguf"):
        shutil.copy(file, several / name)
    with pytest.raises(GGUFError, match=r"a\.Q4_0\.gguf, a\.Q8_0\.gguf.*--gguf-file"):
        locate_gguf(str(several))
    assert locate_gguf(str(several), "a.Q8_0.gguf") == (several / "a.Q8_0.gguf").resolve()
    with pytest.raises(GGUFError, match="--gguf-file b.gguf"):
        locate_gguf(str(several), "b.gguf")
    with pytest.raises(GGUFError, match="must be a .gguf"):
        locate_gguf(str(model / "config.json"))


def test_snapshot_holds_the_files_tensors_tokenizer_and_template(tiny_qwen2, converted) -> None:
    model, file = tiny_qwen2
    assert converted.converted and converted.source == file
    original = load_file(str(model / "model.safetensors"))
    snapshot = load_file(str(converted.path / "model.safetensors"))
    # Tied embeddings: lm_head is stored once, as embed_tokens.
    assert set(snapshot) == set(original) - {"lm_head.weight"}
    for name, tensor in snapshot.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, original[name]), name
    import json

    config = json.loads((converted.path / "config.json").read_text())
    assert config["model_type"] == "qwen2" and "quantization_config" not in config
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted.path)
    assert "assistant: " in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    text = "Testing API: generate text, stream tokens"
    original_tokenizer = AutoTokenizer.from_pretrained(model)
    assert tokenizer(text, add_special_tokens=False).input_ids == original_tokenizer(
        text, add_special_tokens=False
    ).input_ids


def test_second_call_reuses_the_snapshot(tiny_qwen2, converted) -> None:
    cache = converted.path.parent.parent
    stamp = (converted.path / "model.safetensors").stat().st_mtime_ns
    lines: list[str] = []
    again = ensure_snapshot(tiny_qwen2[1], cache, log=lines.append)
    assert again.path == converted.path and not again.converted and lines == []
    assert (converted.path / "model.safetensors").stat().st_mtime_ns == stamp


def test_download_resolve_model_converts_gguf(tiny_qwen2, converted, monkeypatch) -> None:
    """`tokenwire shard --model-id x.gguf` (shard/tools/download.resolve_model) uses the same cache."""
    from shard.tools.download import resolve_model

    monkeypatch.setenv("TOKENWIRE_CACHE", str(converted.path.parent.parent))
    assert resolve_model(str(tiny_qwen2[1])) == converted.path


def test_damaged_files_fail_with_one_line_and_leave_no_snapshot(tiny_qwen2, tmp_path) -> None:
    data = tiny_qwen2[1].read_bytes()
    cache = tmp_path / "cache"
    not_gguf = tmp_path / "noise.gguf"
    not_gguf.write_bytes(b"\x00" * 4096)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    header_only = tmp_path / "header-only.gguf"
    header_only.write_bytes(data[:64])
    for path, message in (
        (not_gguf, "not a GGUF file"),
        (truncated, "unreadable GGUF file"),
        (header_only, "unreadable GGUF file"),
    ):
        with pytest.raises(GGUFError, match=message) as err:
            ensure_snapshot(path, cache, log=lambda _: None)
        assert "\n" not in str(err.value) and str(path) in str(err.value)
        assert cache_entries(cache) == [], path
    with pytest.raises(GGUFError, match="no such GGUF file"):
        ensure_snapshot(tmp_path / "absent.gguf", cache)


@pytest.mark.parametrize("arch", ["gpt2", "made-up-arch"])
def test_unsupported_architecture_names_it_and_the_supported_ones(arch, tmp_path) -> None:
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(arch)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache = tmp_path / "cache"
    with pytest.raises(GGUFError) as err:
        ensure_snapshot(path, cache, log=lambda _: None)
    message = str(err.value)
    assert f"architecture {arch!r} is not supported" in message, message
    assert "llama, mistral, phi3, qwen2, qwen3" in message and "\n" not in message
    assert cache_entries(cache) == []


def test_interrupted_conversion_is_never_trusted(tiny_qwen2, tmp_path) -> None:
    """A .partial directory left by a killed conversion (its process gone) is not a snapshot:
    the next call converts again and removes it."""
    from shard.tools.gguf import KEY_CHARS, file_sha256

    cache = tmp_path / "cache"
    sha = file_sha256(tiny_qwen2[1])
    dead_pid = 2**22 + 1  # above the default pid_max (4194304)
    partial = cache / "gguf" / f".partial-{sha[:KEY_CHARS]}-{dead_pid}"
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")
    snapshot = ensure_snapshot(tiny_qwen2[1], cache, log=lambda _: None)
    assert snapshot.converted and (snapshot.path / PROVENANCE).is_file()
    assert cache_entries(cache) == [sha[:KEY_CHARS]]
