"""GGUF models: converted once into a cached safetensors snapshot that shards load like any other.

A `.gguf` file (or a directory / hub repo holding one) goes through transformers' own GGUF support
(`from_pretrained(dir, gguf_file=name)`, which reads the file with the `gguf` package and
dequantizes it); the result is written as an ordinary snapshot (config.json,
generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json, the chat template)
under CACHE/gguf/<sha256 of the file>, so a second launch, or a shard started after the launcher,
finds it without converting again. Weights are stored as dequantized (float32): `--dtype` then
applies to them exactly as to any checkpoint when a shard loads them; or, with `packed`, the
tensor-parallel linears stored as Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K are repacked into the shard's
integer layout instead (shard/tools/gguf_repack.py; CUDA serving: the CPU path dequantizes each
such weight per matmul, slower than float), under CACHE/gguf/<sha256>-packed2.

Atomicity: the snapshot is built in CACHE/gguf/.partial-<sha>-<pid> and renamed into place in one
step; only complete snapshots ever carry the final name, and an interrupted conversion leaves a
`.partial-*` directory that no launch trusts (it is removed by the next conversion once its
process is gone).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
PROVENANCE = "tokenwire-gguf.json"
# A hash prefix long enough to never collide among one user's files; keeps paths short.
KEY_CHARS = 32
# Snapshots whose linears stay quantized (gguf_repack.py) live beside the float ones.
PACKED_SUFFIX = "-packed2"  # 2: the token embedding / LM head kept packed too (gguf_repack.TABLES)

Log = Callable[[str], None]


class GGUFError(Exception):
    """A GGUF model that cannot be served; the message is one line meant for the user."""


@dataclass(frozen=True)
class GGUFSnapshot:
    """Where a GGUF file's converted snapshot lives."""

    path: Path  # the snapshot directory (config.json, model.safetensors, tokenizer.json, ...)
    source: Path  # the .gguf file it was made from
    sha256: str  # of the .gguf file's bytes: the cache key
    converted: bool  # True when this call did the conversion, False when it reused the cache


# Native model types whose GGUF files are refused until a test converts and serves one.
GGUF_UNTESTED = frozenset({"mixtral", "qwen2_moe", "qwen3_moe"})


def _stderr(message: str) -> None:
    print(f"tokenwire gguf: {message}", file=sys.stderr, flush=True)


def supported_model_types() -> list[str]:
    """model_types tokenwire serves from GGUF: those of its own model registry that
    transformers' GGUF loader reads (the conversion goes through it; OLMo-2, say, is native
    but has no GGUF mapping there), but the mixtures of experts: their GGUF experts (stacked
    `ffn_*_exps` tensors) through the conversion into the per-expert layout the native loader
    reads are not tested yet."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    from shard.models import model_registry

    return sorted((set(model_registry()) & set(GGUF_CONFIG_MAPPING)) - GGUF_UNTESTED)


def locate_gguf(model_id: str, gguf_file: str | None = None, revision: str | None = None) -> Path | None:
    """The local .gguf file `model_id` names, or None when it names an ordinary snapshot.

    model_id may be a .gguf file, a local directory (with no config.json) holding .gguf files, or
    with `gguf_file` a hub repo, whose file is fetched through huggingface_hub (HF cache, honours
    HF_HUB_OFFLINE). `gguf_file` picks one file where a directory holds several."""
    local = Path(model_id).expanduser()
    if local.is_file():
        if local.suffix != GGUF_SUFFIX:
            raise GGUFError(f"--model-id {model_id}: a file must be a {GGUF_SUFFIX} model")
        return local.resolve()
    if local.is_dir():
        if gguf_file is not None:
            chosen = local / gguf_file
            if not chosen.is_file():
                raise GGUFError(f"--gguf-file {gguf_file}: no such file in {local}")
            return chosen.resolve()
        if (local / "config.json").is_file():
            return None
        found = sorted(p.name for p in local.glob(f"*{GGUF_SUFFIX}"))
        if len(found) > 1:
            raise GGUFError(
                f"--model-id {model_id} holds several GGUF files ({', '.join(found)}): pick one "
                "with --gguf-file NAME"
            )
        return (local / found[0]).resolve() if found else None
    if gguf_file is None:
        return None
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id=model_id, filename=gguf_file, revision=revision))


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _check_magic(path: Path) -> None:
    with path.open("rb") as f:
        if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (no GGUF magic at its start)")


def _gguf_architecture(path: Path) -> str:
    """general.architecture from the file's metadata, through the `gguf` package's reader."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except Exception as exc:  # noqa: BLE001 - whatever the reader meets in a damaged file
        raise GGUFError(f"{path}: unreadable GGUF file (corrupt or truncated?): {exc}") from None


def read_config(path: Path):
    """The transformers config of a GGUF file; GGUFError when tokenwire cannot serve it."""
    from transformers import AutoConfig

    supported = supported_model_types()
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001 - sorted out below into one line for the user
        arch = _gguf_architecture(path)  # raises GGUFError when the file itself is damaged
        if arch in supported:
            raise GGUFError(f"{path}: cannot read its {arch} metadata: {exc}") from None
        raise GGUFError(
            f"{path}: GGUF architecture {arch!r} is not supported; tokenwire serves GGUF files of "
            f"{', '.join(supported)}"
        ) from None
    if config.model_type not in supported:
        raise GGUFError(
            f"{path}: GGUF architecture {config.model_type!r} is not supported; tokenwire serves "
            f"GGUF files of {', '.join(supported)}"
        )
    return config


def _log_linears(snapshot: Path, log: Log) -> None:
    """Says what a packed snapshot keeps quantized (from its provenance)."""
    try:
        line = json.loads((snapshot / PROVENANCE).read_text()).get("linears")
    except ValueError:
        line = None
    if line:
        log(line)


def _remove_stale_partials(root: Path, sha: str) -> None:
    """Deletes .partial-<sha>-<pid> (and .partial-<sha>-packed2-<pid>) directories whose
    converting process is gone."""
    for partial in root.glob(f".partial-{sha[:KEY_CHARS]}-*"):
        try:
            pid = int(partial.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(partial, ignore_errors=True)
        except (ValueError, PermissionError):
            continue


@contextlib.contextmanager
def _one_reader_per_file() -> Iterator[None]:
    """transformers parses the GGUF file anew for the config, the tokenizer and the weights (four
    `gguf.GGUFReader`s, each walking every metadata field: ~24 of the default model's 50 s of
    conversion on a loaded 2-core host). transformers imports the reader from the `gguf` module at
    call time, so for the conversion that name hands out one read-only reader per file.

    The same holds for `gguf.get_tensor_name_map`: transformers' weight-name mapping builds a new
    `TensorNameMap` (every tensor name of every block, ~35 ms) for each of the model's modules it
    walks (397 for the default model: ~10 s of the conversion); the map depends only on the
    architecture and the block count and is only read, so one per pair serves every call."""
    import gguf

    original = gguf.GGUFReader
    original_name_map = gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}
    name_maps: dict[tuple[object, int], object] = {}

    def shared_reader(path: str | os.PathLike[str], mode: str = "r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    def shared_name_map(arch, n_blocks: int):
        key = (arch, n_blocks)
        if key not in name_maps:
            name_maps[key] = original_name_map(arch, n_blocks)
        return name_maps[key]

    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = shared_name_map
    try:
        yield
    finally:
        gguf.GGUFReader = original
        gguf.get_tensor_name_map = original_name_map


def convert(path: Path, out: Path, log: Log = _stderr, packed: bool = False) -> str | None:
    """Writes the snapshot of GGUF file `path` into the (existing, empty) directory `out`.
    packed: the tensor-parallel linears stored in Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K stay quantized
    (shard/tools/gguf_repack.py); returns the line saying what was kept and what dequantized."""
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    started = time.monotonic()

    def step(n: int, what: str) -> None:
        log(f"[{n}/4] {what} ({time.monotonic() - started:.0f}s)")

    with _one_reader_per_file():
        step(1, "reading the model's metadata")
        config = read_config(path)
        step(2, "reading the tokenizer and chat template")
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        step(3, "dequantizing the weights")
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, **_dequantize_option(path)
        )
        kept: dict[str, dict[str, torch.Tensor]] = {}
        summary = None
        if packed:  # the same reader: the file's blocks, checked against the float tensors
            from shard.tools.gguf_repack import repack_linears

            kept, summary = repack_linears(path, model, model.state_dict())
    step(4, "writing safetensors")
    # save_pretrained refuses models loaded through the GGUF quantizer, so the tensors are
    # written here. Tied parameters (embed_tokens / lm_head) share storage: the first name in
    # module order is kept, as checkpoints with tied embeddings do.
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in model.state_dict().items():
        storage = tensor.untyped_storage().data_ptr()
        if storage not in storages:
            storages.add(storage)
            tensors[name] = tensor.contiguous()
    for prefix, parts in kept.items():  # the packed tensors replace the float weight
        del tensors[f"{prefix}.weight"]
        tensors.update({f"{prefix}.{suffix}": t for suffix, t in parts.items()})
    safetensors.torch.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config_dict = model.config.to_diff_dict()
    config_dict.pop("quantization_config", None)  # transformers' GGUF one: not a checkpoint's
    for key in ("_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)
    config_dict["architectures"] = [type(model).__name__]
    if summary is not None and summary.types():
        config_dict["quantization_config"] = {"quant_method": "gguf",
                                              "types": dict(sorted(summary.types().items()))}
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    log(f"converted in {time.monotonic() - started:.0f}s")
    return None if summary is None else summary.line()


def _dequantize_option(path: Path) -> dict:
    """Asks transformers for plain float weights even where a GGUF matmul kernel is installed
    (which would otherwise keep the weights packed and unsaveable). Older transformers releases
    have no GgufConfig and always dequantize."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(gguf_file=path.name, dequantize=True)}


def ensure_snapshot(path: Path, cache: Path, log: Log = _stderr, packed: bool = False
                    ) -> GGUFSnapshot:
    """The cached snapshot of GGUF file `path`, converting it first when the cache has none.
    packed: linears of the types gguf_repack.py keeps stay quantized (a snapshot of its own,
    `<key>-packed2`); what was kept and what dequantized is logged at every start-up."""
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    _check_magic(path)
    sha = file_sha256(path)
    root = cache / "gguf"
    key = sha[:KEY_CHARS] + (PACKED_SUFFIX if packed else "")
    target = root / key
    if (target / PROVENANCE).is_file():
        if packed:
            _log_linears(target, log)
        return GGUFSnapshot(target, path, sha, converted=False)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(root, sha)
    size_mb = path.stat().st_size / 2**20
    log(f"converting {path.name} ({size_mb:.0f} MB) once into {target}")
    staging = root / f".partial-{key}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        linears = convert(path, staging, log, packed=packed)
        provenance = {"source": path.name, "sha256": sha, "size_bytes": path.stat().st_size}
        if linears is not None:
            provenance["linears"] = linears
            log(linears)
        # Written last: a snapshot without it is incomplete (belt and braces with the rename).
        (staging / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
        try:
            staging.rename(target)
        except OSError:  # another launch converted the same file first: theirs is as good
            if not (target / PROVENANCE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return GGUFSnapshot(target, path, sha, converted=True)
