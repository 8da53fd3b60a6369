"""PEFT LoRA adapters on disk: resolve a directory (or hub id), read adapter_config.json and
adapter_model.safetensors, validate everything against the base model, and cut this rank's
slice — all before anything is registered, so a bad adapter never ends up half-loaded.

The format is the one `peft` writes (`PeftModel.save_pretrained`): tensors named
`base_model.model.<module>.lora_A.weight` [r, in_features] and `...lora_B.weight`
[out_features, r]; the forward adds `lora_B(lora_A(x)) * scaling`, with scaling = alpha / r
(alpha / sqrt(r) with `use_rslora`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from shard.errors import InvalidRequestError
from shard.layers.lora import LoraPart

# Projections tokenwire's model code can adapt (Llama family names).
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Checkpoint-fused projections (Phi-3's): an adapter on one adapts each of its parts with the same
# A and the part's rows of B, the parts in row order.
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                 "gate_up_proj": ("gate_proj", "up_proj")}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


class AdapterLoadError(InvalidRequestError):
    """The adapter cannot be served; the message names the adapter and the problem."""


@dataclass(frozen=True)
class AdapterSource:
    """Where an adapter comes from: a local directory or a hub repo id."""

    name: str
    path: str
    revision: str | None = None


@dataclass(frozen=True)
class AdapterFacts:
    """What Info and ListAdapters report about a loaded adapter."""

    name: str
    source: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # projection names it adapts, e.g. ("q_proj", "v_proj")


@dataclass
class HostAdapter:
    """A validated adapter in host memory, already cut to this rank's slices: checkpoint module
    name -> (A [r, in_local], B [out_local, r] with the scaling folded in)."""

    facts: AdapterFacts
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.tensors.values())


def check_name(name: str) -> None:
    if not ADAPTER_NAME.match(name):
        raise AdapterLoadError(
            f"adapter name {name!r} is invalid: 1-128 characters of letters, digits, '.', '_' "
            f"and '-', starting with a letter or digit"
        )


def resolve_dir(source: AdapterSource) -> Path:
    """The local directory holding the adapter's files."""
    local = Path(source.path).expanduser()
    if local.is_dir():
        return local.resolve()
    if local.exists():
        raise AdapterLoadError(f"adapter '{source.name}': {source.path} is not a directory")
    if source.path.startswith(("/", ".", "~")) or source.path.count("/") != 1:
        raise AdapterLoadError(
            f"adapter '{source.name}': directory {source.path} not found (and it is not a hub "
            f"repo id of the form org/name)"
        )
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(
            repo_id=source.path, revision=source.revision,
            allow_patterns=[CONFIG_FILE, WEIGHTS_FILE],
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - offline, unknown repo, auth: all one message
        raise AdapterLoadError(
            f"adapter '{source.name}': cannot fetch hub repo {source.path}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return Path(path)


def _config(name: str, directory: Path, max_rank: int) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise AdapterLoadError(
            f"adapter '{name}': {directory} has no {CONFIG_FILE} (a PEFT LoRA adapter directory "
            f"holds {CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    try:
        cfg = json.loads(path.read_text())
    except ValueError as exc:
        raise AdapterLoadError(f"adapter '{name}': {path} is not valid JSON ({exc})") from exc
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterLoadError(f"adapter '{name}': peft_type {peft_type} is not supported (LORA)")
    unsupported = [
        ("use_dora", bool(cfg.get("use_dora")), "DoRA adapters"),
        ("bias", cfg.get("bias", "none") not in ("none", None), "trained biases"),
        ("lora_bias", bool(cfg.get("lora_bias")), "LoRA biases"),
        ("modules_to_save", bool(cfg.get("modules_to_save")), "fully trained extra modules"),
        ("fan_in_fan_out", bool(cfg.get("fan_in_fan_out")), "Conv1D (fan_in_fan_out) weights"),
        ("rank_pattern", bool(cfg.get("rank_pattern")), "per-module ranks"),
        ("alpha_pattern", bool(cfg.get("alpha_pattern")), "per-module alphas"),
    ]
    for key, present, what in unsupported:
        if present:
            raise AdapterLoadError(
                f"adapter '{name}': {key}={cfg.get(key)!r} in {CONFIG_FILE}: {what} are not "
                f"supported"
            )
    targets = cfg.get("target_modules")
    if isinstance(targets, list):  # (a string is a regex: the tensors are checked instead)
        bad = [t for t in targets
               if t.rpartition(".")[2] not in (*SUPPORTED_TARGETS, *FUSED_TARGETS)]
        if bad:
            raise AdapterLoadError(
                f"adapter '{name}': target module {bad[0]!r} is not supported (target_modules "
                f"{targets}); supported: {', '.join((*SUPPORTED_TARGETS, *FUSED_TARGETS))}"
            )
    r = cfg.get("r")
    if not isinstance(r, int) or r <= 0:
        raise AdapterLoadError(f"adapter '{name}': {CONFIG_FILE} needs a positive integer r")
    if r > max_rank:
        raise AdapterLoadError(
            f"adapter '{name}': rank {r} exceeds --max-lora-rank {max_rank}; restart the shards "
            f"with a larger --max-lora-rank"
        )
    return cfg


def _check_shape(name: str, tensor: str, got: torch.Size, want: tuple[int, int], what: str
                 ) -> None:
    if tuple(got) != want:
        raise AdapterLoadError(
            f"adapter '{name}': {tensor} has shape {list(got)} but the base model needs "
            f"{list(want)} ({what}); was the adapter trained for another base model?"
        )


def _fused_parts(module: str, targets: dict[str, LoraPart]) -> list[str] | None:
    """The part modules (row order) a fused target such as `...self_attn.qkv_proj` stands for,
    where the model has them all; None for any other module."""
    parent, _, leaf = module.rpartition(".")
    if leaf not in FUSED_TARGETS:
        return None
    names = [f"{parent}.{p}" if parent else p for p in FUSED_TARGETS[leaf]]
    return names if all(n in targets for n in names) else None


def read_adapter(
    source: AdapterSource,
    targets: dict[str, LoraPart],
    max_rank: int,
    dtype: torch.dtype,
    pin: bool = False,
) -> HostAdapter:
    """Reads and validates an adapter against `targets` (checkpoint module name -> the part it
    adapts); returns this rank's slices. Raises AdapterLoadError naming the problem."""
    check_name(source.name)
    name = source.name
    directory = resolve_dir(source)
    cfg = _config(name, directory, max_rank)
    r = int(cfg["r"])
    alpha = float(cfg.get("lora_alpha", r))
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        other = " (only safetensors is read; adapter_model.bin is not)" if (
            directory / "adapter_model.bin").is_file() else ""
        raise AdapterLoadError(f"adapter '{name}': {directory} has no {WEIGHTS_FILE}{other}")
    try:
        handle = safe_open(str(weights), framework="pt")
        keys = list(handle.keys())
    except Exception as exc:  # noqa: BLE001 - a corrupt or truncated file
        raise AdapterLoadError(f"adapter '{name}': cannot read {weights}: {exc}") from exc
    found: dict[str, dict[str, str]] = {}
    for key in keys:
        m = _TENSOR.match(key)
        if m is None:
            raise AdapterLoadError(
                f"adapter '{name}': tensor {key!r} is not a LoRA A/B weight (embedding LoRA, "
                f"biases and extra modules are not supported)"
            )
        module = m["module"]
        if module not in targets and _fused_parts(module, targets) is None:
            leaf = module.rpartition(".")[2]
            if leaf not in (*SUPPORTED_TARGETS, *FUSED_TARGETS):
                raise AdapterLoadError(
                    f"adapter '{name}': target module {leaf!r} ({module}) is not supported; "
                    f"supported: {', '.join((*SUPPORTED_TARGETS, *FUSED_TARGETS))}"
                )
            raise AdapterLoadError(
                f"adapter '{name}': the base model has no module {module} (was the adapter "
                f"trained for another base model?)"
            )
        found.setdefault(module, {})[m["ab"]] = key
    if not found:
        raise AdapterLoadError(f"adapter '{name}': {WEIGHTS_FILE} holds no LoRA weights")
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise AdapterLoadError(f"adapter '{name}': {module} has no {missing} weight")
        parts = _fused_parts(module, targets) or [module]  # what it adapts, in B's row order
        in_features = targets[parts[0]].in_features
        out_features = sum(targets[p].out_features for p in parts)
        a_slice, b_slice = handle.get_slice(ab["A"]), handle.get_slice(ab["B"])
        _check_shape(name, ab["A"], a_slice.get_shape(), (r, in_features),
                     f"rank {r} x {in_features} input features")
        _check_shape(name, ab["B"], b_slice.get_shape(), (out_features, r),
                     f"{out_features} output features x rank {r}")
        offset = 0  # the part's first row in B
        for p in parts:
            part = targets[p]
            if p in tensors:
                raise AdapterLoadError(f"adapter '{name}': {p} is adapted twice (as itself "
                                       f"and through a fused projection)")
            a = a_slice[:, part.in_slice[0] : part.in_slice[1]]
            b = b_slice[offset + part.out_slice[0] : offset + part.out_slice[1]]
            offset += part.out_features
            a = a.to(dtype).contiguous()
            b = (b.float() * scaling).to(dtype).contiguous()
            if pin:
                a, b = a.pin_memory(), b.pin_memory()
            tensors[p] = (a, b)
    targets_used = tuple(sorted({m.rpartition(".")[2] for m in tensors}))
    facts = AdapterFacts(name, source.path, r, alpha, targets_used)
    return HostAdapter(facts, tensors)


def parse_adapters_flag(value: str | None) -> list[AdapterSource]:
    """--lora-adapters "name=path,name2=org/repo" (TGI's LORA_ADAPTERS also takes bare ids:
    their name is the id itself, or the directory's name for a path)."""
    out: list[AdapterSource] = []
    for item in (value or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, path = item.partition("=")
        if not sep:
            path = name
            name = Path(name.rstrip("/")).name if name.startswith(("/", ".", "~")) else name
            name = name.replace("/", "--")
        out.append(AdapterSource(name.strip(), path.strip()))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-adapters names an adapter twice: {names}")
    return out
