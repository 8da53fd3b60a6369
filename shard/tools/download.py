"""Model resolution: a local directory as is, else a Hugging Face Hub snapshot.

`tokenwire download MODEL_ID` pre-fetches a snapshot into the HF cache (HF_HOME /
HF_HUB_CACHE are honoured by huggingface_hub itself); with HF_HUB_OFFLINE=1 only the cache is
consulted, which is how shards start on machines without network access.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# What a shard needs from a snapshot; other files (pytorch_model.bin, onnx, ...) are skipped.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.py"]


def resolve_model(model_id: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """The local directory holding model_id's files (config.json, safetensors, tokenizer).
    A .gguf file, or a local directory of one, resolves to its converted snapshot in tokenwire's
    cache (shard/tools/gguf.py)."""
    from shard.tools.cache import cache_dir as tokenwire_cache_dir
    from shard.tools.gguf import ensure_snapshot, locate_gguf

    gguf = locate_gguf(model_id, None, revision)
    if gguf is not None:
        return ensure_snapshot(gguf, tokenwire_cache_dir()).path
    local = Path(model_id).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"--model-id {model_id}: directory has no config.json")
        return local.resolve()
    from huggingface_hub import snapshot_download

    path = snapshot_download(
        repo_id=model_id,
        revision=revision,
        cache_dir=cache_dir,
        allow_patterns=ALLOW_PATTERNS,
    )
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(
            f"--model-id {model_id}: the hub snapshot has no config.json (for a repo of GGUF "
            "files, name one with --gguf-file NAME)"
        )
    return Path(path)


def model_sha(path: Path) -> str | None:
    """The commit of a hub snapshot (its directory name under snapshots/), else None."""
    return path.name if path.parent.name == "snapshots" else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_id", help="hub id (org/name) or local directory")
    parser.add_argument("--revision", default=None, help="branch, tag or commit")
    parser.add_argument("--cache-dir", default=None, help="override the HF cache directory")


def run(args: argparse.Namespace) -> int:
    path = resolve_model(args.model_id, args.revision, args.cache_dir)
    print(path)
    return 0
