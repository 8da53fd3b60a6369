"""Which quantization a shard runs with: the `--quantize` / `--kv-cache-dtype` values and what a
checkpoint's own config.json says.

Plain data and parsing only; no torch import, so the CLI can validate flags cheaply.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class QuantizeMethod(enum.Enum):
    """Weight quantization of the linear layers (embeddings, norms and the LM head stay in the
    model dtype)."""

    BITSANDBYTES = "bitsandbytes"  # LLM.int8(): int8 per-row absmax, fp16 outlier columns
    BITSANDBYTES_NF4 = "bitsandbytes-nf4"  # 4-bit NormalFloat, blocks of 64, bf16 compute
    FP8 = "fp8"  # float8_e4m3fn per output channel; torch._scaled_mm on sm_89+

    @property
    def flag(self) -> str:
        return f"--quantize {self.value}"


QUANTIZE_CHOICES: tuple[str, ...] = tuple(m.value for m in QuantizeMethod)


def parse_quantize(value: str | None) -> QuantizeMethod | None:
    """Parses a `--quantize` value; None / "" / "none" mean no quantization."""
    if value is None:
        return None
    normalized = value.strip().lower().replace("_", "-")
    if normalized in ("", "none"):
        return None
    aliases = {
        "bitsandbytes-int8": "bitsandbytes",
        "int8": "bitsandbytes",
        "nf4": "bitsandbytes-nf4",
    }
    normalized = aliases.get(normalized, normalized)
    for method in QuantizeMethod:
        if method.value == normalized:
            return method
    raise ValueError(
        f"--quantize: unknown value {value!r}; expected one of {', '.join(QUANTIZE_CHOICES)}"
    )


class KvCacheDtype(enum.Enum):
    """Storage dtype of the paged KV cache. AUTO stores K/V in the model dtype."""

    AUTO = "auto"
    FP8_E4M3FN = "fp8_e4m3fn"
    FP8_E5M2 = "fp8_e5m2"

    @property
    def is_fp8(self) -> bool:
        return self is not KvCacheDtype.AUTO


KV_CACHE_DTYPE_CHOICES: tuple[str, ...] = tuple(d.value for d in KvCacheDtype)


def parse_kv_cache_dtype(value: str | None) -> KvCacheDtype:
    """Parses `--kv-cache-dtype`; "fp8" is an alias of fp8_e4m3fn (the one the paged kernels read)."""
    if value is None:
        return KvCacheDtype.AUTO
    normalized = value.strip().lower()
    if normalized in ("", "auto", "none"):
        return KvCacheDtype.AUTO
    if normalized in ("fp8", "fp8_e4m3", "float8_e4m3fn"):
        return KvCacheDtype.FP8_E4M3FN
    if normalized in ("float8_e5m2",):
        return KvCacheDtype.FP8_E5M2
    for dtype in KvCacheDtype:
        if dtype.value == normalized:
            return dtype
    raise ValueError(
        f"--kv-cache-dtype: unknown value {value!r}; expected one of "
        f"{', '.join(KV_CACHE_DTYPE_CHOICES)}"
    )


class Fp8ScaleLayout(enum.Enum):
    """How a pre-quantized fp8 checkpoint stores each weight's scale (see fp8.py)."""

    TENSOR = "tensor"  # `weight_scale`: one float32 per tensor (AutoFP8 / llm-compressor "fp8")
    CHANNEL = "channel"  # `weight_scale`: [out] or [out, 1] float32 (compressed-tensors "channel")
    BLOCK = "block"  # `weight_scale_inv`: [ceil(out/bo), ceil(in/bi)] (DeepSeek-V3 style blocks)


class IntLayout(enum.Enum):
    """How a pre-quantized integer checkpoint packs a linear's weight (int_weights.py unpacks each
    into the one internal layout the kernels read)."""

    GPTQ = "gptq"  # AutoGPTQ / GPTQModel v1: qweight [in/pack, out], qzeros (stored zero - 1)
    AWQ = "awq"  # AutoAWQ GEMM: qweight [in, out/8] in AWQ's interleaved nibble order
    # compressed-tensors `pack-quantized` (llm-compressor W4A16 / W8A16): weight_packed
    # [out, in * bits / 32], values offset by 2^(bits-1); asymmetric zero points packed by rows.
    PACK_QUANTIZED = "pack-quantized"
    # compressed-tensors `int-quantized` W8A8-int8: `weight` int8 [out, in] with per-channel (or
    # per-tensor) `weight_scale`; activations quantized per token at run time (w8a8.py).
    INT_QUANTIZED = "int-quantized"
    # tokenwire's GGUF snapshots (shard/tools/gguf_repack.py): GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K /
    # Q6_K blocks repacked at conversion into the internal layout, per linear `qweight` uint8,
    # `scales` and `zeros` [out, groups], `gguf_type` (the GGML type number: bits and group size).
    GGUF = "gguf"

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The per-linear tensor suffixes, the one that marks a quantized linear first (optional
        ones included)."""
        if self is IntLayout.PACK_QUANTIZED:
            return ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                    "weight_g_idx")
        if self is IntLayout.INT_QUANTIZED:
            # weight_scale first: a layer the checkpoint left unquantized has `weight` only.
            return ("weight_scale", "weight", "weight_zero_point")
        if self is IntLayout.GGUF:
            return ("gguf_type", "qweight", "scales", "zeros")
        return ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class IntWeightFormat:
    """A pre-quantized int4 / int8 checkpoint: weight-only (W4A16 / W8A16), or W8A8-int8 for
    INT_QUANTIZED (int8 weights and per-token dynamic int8 activations). GGUF snapshots mix
    types per linear: bits and group_size then give the smallest of its types, each linear's own come
    from its `gguf_type`."""

    layout: IntLayout
    bits: int  # 4 or 8
    group_size: int  # input features per scale; -1: one group over all inputs (per channel)
    symmetric: bool  # informative: the stored zero points are used either way (exact)
    act_order: bool  # GPTQ desc_act: g_idx maps input features to groups in any order


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a checkpoint's config.json `quantization_config` says about its stored weights."""

    # fp8 checkpoints: QuantizeMethod.FP8; integer checkpoints: None (see `packed`).
    method: QuantizeMethod | None
    # fp8 only: how scales are laid out; block shape [bo, bi] for BLOCK.
    scale_layout: Fp8ScaleLayout | None = None
    weight_block_size: tuple[int, int] | None = None
    # "dynamic" or "static"; tokenwire always quantizes activations dynamically (static
    # `input_scale` tensors are ignored: dynamic per-token scales are at least as accurate).
    activation_scheme: str = "dynamic"
    # Module name fragments left unquantized in the checkpoint (e.g. "lm_head").
    ignored: tuple[str, ...] = field(default_factory=tuple)
    # Integer checkpoints (GPTQ / AWQ): how each linear's weight is packed.
    packed: IntWeightFormat | None = None

    def is_ignored(self, prefix: str) -> bool:
        return any(
            prefix == name or prefix.startswith(name + ".") or prefix.endswith(name)
            for name in self.ignored
        )


def checkpoint_quantization(config: Mapping[str, Any]) -> CheckpointQuantization | None:
    """Reads a model config.json (as a dict) and returns how its weights are pre-quantized, or
    None for a plain checkpoint. Raises ValueError for a quantized format tokenwire cannot load.

    Recognized:
    - {"quant_method": "fp8", "activation_scheme": ..., ["weight_block_size": [128, 128]],
       ["ignored_layers" | "modules_to_not_convert": [...]]} — per-tensor `weight_scale`, or
       block-wise `weight_scale_inv` when weight_block_size is given.
    - {"quant_method": "fbgemm_fp8", ...} — per-channel `weight_scale` [out, 1].
    - {"quant_method": "compressed-tensors", "config_groups": {..."weights": {"num_bits": 8,
       "type": "float", "strategy": "tensor"|"channel"|"block", "block_structure": [..]}}} .
    - compressed-tensors integer weights: `pack-quantized` (W4A16 / W8A16) and `int-quantized`
      (W8A8-int8, dynamic per-token activations).
    - {"quant_method": "gptq" | "awq", ...} and tokenwire's own GGUF snapshots ("gguf").
    """
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    ignored = tuple(
        qc.get("ignored_layers") or qc.get("modules_to_not_convert") or qc.get("ignore") or ()
    )
    if method == "fp8":
        block = qc.get("weight_block_size")
        return CheckpointQuantization(
            method=QuantizeMethod.FP8,
            scale_layout=Fp8ScaleLayout.BLOCK if block else Fp8ScaleLayout.TENSOR,
            weight_block_size=(int(block[0]), int(block[1])) if block else None,
            activation_scheme=str(qc.get("activation_scheme", "dynamic")),
            ignored=ignored,
        )
    if method == "fbgemm_fp8":
        return CheckpointQuantization(
            method=QuantizeMethod.FP8, scale_layout=Fp8ScaleLayout.CHANNEL, ignored=ignored
        )
    if method == "compressed-tensors":
        packed = _pack_quantized_format(qc)
        if packed is not None:
            return CheckpointQuantization(method=None, packed=packed, ignored=ignored)
        groups = qc.get("config_groups") or {}
        for group in groups.values():
            weights = group.get("weights") or {}
            if weights.get("type") == "float" and int(weights.get("num_bits", 0)) == 8:
                strategy = str(weights.get("strategy", "tensor"))
                block = weights.get("block_structure")
                layout = {
                    "tensor": Fp8ScaleLayout.TENSOR,
                    "channel": Fp8ScaleLayout.CHANNEL,
                    "block": Fp8ScaleLayout.BLOCK,
                }.get(strategy)
                if layout is None:
                    break
                acts = group.get("input_activations") or {}
                return CheckpointQuantization(
                    method=QuantizeMethod.FP8,
                    scale_layout=layout,
                    weight_block_size=(int(block[0]), int(block[1])) if block else None,
                    activation_scheme="dynamic" if acts.get("dynamic", True) else "static",
                    ignored=ignored,
                )
        raise ValueError(
            "quantization_config: compressed-tensors checkpoints are supported only as fp8 "
            "(8-bit float weights, tensor/channel/block strategy)"
        )
    if method == "gguf":
        return CheckpointQuantization(method=None, packed=_gguf_format(qc), ignored=ignored)
    if method in ("gptq", "awq"):
        return CheckpointQuantization(method=None, packed=_int_weight_format(qc, method),
                                      ignored=ignored)
    if method == "bitsandbytes":
        raise ValueError(
            "quantization_config: pre-quantized bitsandbytes checkpoints are not supported; load "
            "the unquantized checkpoint with --quantize bitsandbytes or bitsandbytes-nf4"
        )
    raise ValueError(
        f"quantization_config.quant_method: unsupported value {method!r} (supported: fp8, "
        "fbgemm_fp8, compressed-tensors fp8, gptq, awq)"
    )


def _pack_quantized_format(qc: Mapping[str, Any]) -> IntWeightFormat | None:
    """compressed-tensors integer weights (`pack-quantized`, weight-only), or None for a config
    whose groups quantize no integer weights (fp8: the caller's). One config group only."""
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        raise ValueError("quantization_config.config_groups: expected an object")  # noqa: TRY004 - a config value
    ints = {name: g for name, g in groups.items()
            if isinstance(g, Mapping) and (g.get("weights") or {}).get("type") == "int"}
    if not ints:
        return None
    if len(groups) != 1:
        raise ValueError(f"quantization_config.config_groups: {len(groups)} groups; integer "
                         "checkpoints are supported with one group")
    name, group = next(iter(ints.items()))
    where = f"quantization_config.config_groups.{name}"
    fmt = str(group.get("format") or qc.get("format") or "")
    if fmt == "int-quantized":
        return _w8a8_format(group, where)
    if fmt != "pack-quantized":
        raise ValueError(f"quantization_config.format: {fmt!r} is not supported for integer "
                         "weights (supported: pack-quantized, int-quantized)")
    if group.get("input_activations"):
        raise ValueError(f"{where}.input_activations: quantized activations (W8A8) are not "
                         "supported for integer weights yet; weight-only (W4A16 / W8A16) is")
    weights = group["weights"]
    bits = weights.get("num_bits")
    if bits not in (4, 8) or isinstance(bits, bool):
        raise ValueError(f"{where}.weights.num_bits: {bits!r} is not supported (supported: 4, 8)")
    strategy = weights.get("strategy")
    if strategy == "channel":
        size = -1
    elif strategy == "group":
        size = weights.get("group_size")
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or size % 8:
            raise ValueError(f"{where}.weights.group_size: {size!r} is not supported (supported: "
                             "a positive multiple of 8)")
    else:
        raise ValueError(f"{where}.weights.strategy: {strategy!r} is not supported (supported: "
                         "group, channel)")
    return IntWeightFormat(IntLayout.PACK_QUANTIZED, int(bits), size,
                           bool(weights.get("symmetric", True)),
                           weights.get("actorder") not in (None, False, "static"))


def _w8a8_format(group: Mapping[str, Any], where: str) -> IntWeightFormat:
    """compressed-tensors `int-quantized` W8A8-int8: symmetric int8 weights per channel (or per
    tensor), symmetric int8 activations with dynamic per-token scales (vLLM's and
    llm-compressor's W8A8 scheme). Anything else names its field."""
    weights = group["weights"]

    def refuse(name: str, value: Any, supported: str) -> ValueError:
        return ValueError(f"{where}.{name}: {value!r} is not supported for int-quantized "
                          f"(supported: {supported})")

    if weights.get("num_bits") != 8 or isinstance(weights.get("num_bits"), bool):
        raise refuse("weights.num_bits", weights.get("num_bits"), "8")
    if weights.get("strategy") not in ("channel", "tensor"):
        raise refuse("weights.strategy", weights.get("strategy"), "channel, tensor")
    if weights.get("symmetric", True) is not True:
        raise refuse("weights.symmetric", weights.get("symmetric"), "true")
    acts = group.get("input_activations")
    if not isinstance(acts, Mapping):
        raise refuse("input_activations", acts, "8-bit int, dynamic per token")
    if acts.get("type", "int") != "int" or acts.get("num_bits") != 8:
        raise refuse("input_activations.num_bits", acts.get("num_bits"), "8 (type int)")
    if acts.get("strategy", "token") != "token":
        raise refuse("input_activations.strategy", acts.get("strategy"), "token")
    if acts.get("dynamic") is not True:
        raise refuse("input_activations.dynamic", acts.get("dynamic"),
                     "true (static input scales are not)")
    if acts.get("symmetric", True) is not True:
        raise refuse("input_activations.symmetric", acts.get("symmetric"), "true")
    return IntWeightFormat(IntLayout.INT_QUANTIZED, 8, -1, True, False)


# GGML types a tokenwire GGUF snapshot may hold packed: name -> (storage bits, group size);
# gguf_blocks.GGUF_PACKED has them by type number.
GGUF_PACKED_TYPES: dict[str, tuple[int, int]] = {
    "Q8_0": (8, 32), "Q4_0": (4, 32), "Q4_1": (4, 32), "Q4_K": (4, 32), "Q6_K": (8, 16),
}


def _gguf_format(qc: Mapping[str, Any]) -> IntWeightFormat:
    """A snapshot tokenwire converted from a GGUF file keeping linears packed:
    {"quant_method": "gguf", "types": {"Q4_1": <linears>, ...}} (shard/tools/gguf_repack.py)."""
    types = qc.get("types")
    if not isinstance(types, Mapping) or not types:
        raise ValueError("quantization_config.types: expected an object of GGUF type names")
    unknown = sorted(set(types) - set(GGUF_PACKED_TYPES))
    if unknown:
        raise ValueError(f"quantization_config.types: {', '.join(unknown)} not supported "
                         f"(supported: {', '.join(GGUF_PACKED_TYPES)})")
    bits = min(GGUF_PACKED_TYPES[t][0] for t in types)
    group = min(GGUF_PACKED_TYPES[t][1] for t in types)
    return IntWeightFormat(IntLayout.GGUF, bits, group, False, False)


def _int_weight_format(qc: Mapping[str, Any], method: str) -> IntWeightFormat:
    """GPTQ (v1 checkpoint format) or AWQ (GEMM version) settings; a ValueError naming the field
    for anything tokenwire cannot load."""

    def field_error(name: str, value: Any, supported: str) -> ValueError:
        return ValueError(
            f"quantization_config.{name}: {value!r} is not supported for {method} "
            f"(supported: {supported})"
        )

    def integer(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"quantization_config.{name}: {value!r} is not an integer")  # noqa: TRY004
        return value

    if method == "gptq":
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt != "gptq":
            raise field_error("checkpoint_format", fmt, "gptq (the v1 layout)")
        bits = integer("bits", qc.get("bits"))
        if bits not in (4, 8):
            raise field_error("bits", bits, "4, 8")
        group = integer("group_size", qc.get("group_size", -1))
        symmetric = bool(qc.get("sym", True))
        act_order = bool(qc.get("desc_act", False))
        layout = IntLayout.GPTQ
    else:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise field_error("version", version, "gemm")
        name = "w_bit" if "w_bit" in qc else "bits"
        bits = integer(name, qc.get(name))
        if bits != 4:
            raise field_error(name, bits, "4")
        gname = "q_group_size" if "q_group_size" in qc else "group_size"
        group = integer(gname, qc.get(gname, 128))
        if group == -1:
            raise field_error(gname, group, "a positive group size")
        symmetric = not bool(qc.get("zero_point", True))
        act_order = False
        layout = IntLayout.AWQ
    if group != -1 and (group <= 0 or group % 8):
        raise field_error("group_size", group, "-1 or a positive multiple of 8")
    return IntWeightFormat(layout, bits, group, symmetric, act_order)


def with_quantize_config(model_dir: Path, config: dict[str, Any]) -> dict[str, Any]:
    """config.json, with the `quantize_config.json` (older AutoGPTQ) or `quant_config.json`
    (AutoAWQ) beside it as its `quantization_config` when config.json names none."""
    if config.get("quantization_config"):
        return config
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        path = model_dir / name
        if path.is_file():
            try:
                stored = json.loads(path.read_text())
            except ValueError as exc:
                raise ValueError(f"{name}: not valid JSON ({exc})") from None
            if not isinstance(stored, dict):
                raise ValueError(f"{name}: expected a JSON object")
            return {**config, "quantization_config": {"quant_method": method, **stored}}
    return config


class KvCacheRotation(enum.Enum):
    """--kv-cache-rotation: how keys are stored in an fp8 cache (shard/quantization/kv_rotation.py)."""

    HADAMARD = "hadamard"  # rotate q and k (fp8 caches only; model-dtype caches ignore it)
    NONE = "none"


KV_CACHE_ROTATION_CHOICES: tuple[str, ...] = tuple(r.value for r in KvCacheRotation)


def parse_kv_cache_rotation(value: str) -> KvCacheRotation:
    try:
        return KvCacheRotation(value.strip().lower())
    except ValueError:
        raise ValueError(
            f"--kv-cache-rotation: {value!r}; expected one of {', '.join(KV_CACHE_ROTATION_CHOICES)}"
        ) from None
