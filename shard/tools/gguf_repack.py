"""GGUF linears kept quantized: Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K blocks repacked once, at
conversion, into the integer layout the shard serves (shard/quantization/gguf_blocks.py) instead
of dequantized to float; so are the token embedding and an untied LM head (output.weight), which
the shard serves through shard/quantization/embedding.py (the lookup dequantizes only the
gathered rows; the head is an IntLinear; a tied head shares the embedding's). Other types (F16,
Q5_K, IQ*, ...) and the remaining tensors (norms, fused projections) still dequantize.

The integers come out of the `gguf` package's own block decoders: each block is decoded once with
its scale set to 1 and its minimum to 0, which yields the stored integers (minus the type's fixed
offset), while the scales and minimums are read from the block header (Q4_K's 6-bit packed
sub-block scales through gguf's own Q4_K.get_scale_min). Per block of `group` weights:
  Q8_0  w = d * q8          q = q8 + 128, zero 128, scale d
  Q4_0  w = d * (q4 - 8)    zero 8, scale d
  Q4_1  w = d * q4 + m      zero -m / d, scale d
  Q4_K  w = d*sc_j * q4 - dmin*m_j   per sub-block j of 32: scale d*sc_j, zero dmin*m_j / scale
  Q6_K  w = d*sc_j * (q6 - 32)       per sub-block j of 16: scale d*sc_j, zero 32
Scales and zeros are kept in float16 where that holds them exactly, else float32, so the served
weights equal gguf's dequantized ones to float32 rounding. A block whose scale is 0 but whose
minimum is not (a constant block) is stored as q = 0, zero = -1, scale = the constant.

Rows follow transformers' GGUF loader (its TensorProcessor: llama's q/k rows are un-permuted from
llama.cpp's rotary order); the row permutation is read off the processor itself by running it on
row numbers, and every repacked linear is checked against the float tensor transformers made.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from shard.quantization.methods import GGUF_PACKED_TYPES

# The linears the native models load as tensor-parallel layers (fused projections such as
# Phi-3's qkv_proj are read by row ranges and stay float).
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The vocabulary tables (shard.layers.embedding's layers), kept packed the same way.
TABLES = ("embed_tokens", "lm_head")


@dataclass
class RepackSummary:
    """What a conversion kept packed and what it dequantized (GGML type name -> tensors)."""

    packed: Counter[str] = field(default_factory=Counter)  # linears
    tables: Counter[str] = field(default_factory=Counter)  # token embedding / LM head
    dequantized: Counter[str] = field(default_factory=Counter)

    def line(self) -> str:
        def fmt(c: Counter[str]) -> str:
            return ", ".join(f"{k} x{v}" for k, v in sorted(c.items())) or "none"

        tables = f"; embedding / LM head kept quantized: {fmt(self.tables)}" if self.tables else ""
        return (f"linears kept quantized: {fmt(self.packed)}{tables}; dequantized to float: "
                f"{fmt(self.dequantized)}")

    def types(self) -> Counter[str]:
        """Every GGML type kept packed (the snapshot's quantization_config.types)."""
        return self.packed + self.tables


def _f16(value: float) -> np.ndarray:
    return np.array([value], dtype=np.float16).view(np.uint8)


def _half_if_exact(t: torch.Tensor) -> torch.Tensor:
    """float32 -> float16 when every value survives the round trip, else float32."""
    half = t.half()
    return half if torch.equal(half.float(), t) else t


def _integers(blocks: np.ndarray, qtype, *unit: tuple[int, int, np.ndarray]) -> np.ndarray:
    """The blocks decoded by gguf with the header bytes in `unit` replaced (scale 1, min 0):
    [n_blocks, block_size] float32 holding the stored integers (less the type's offset)."""
    from gguf import quants

    ones = blocks.copy()
    for start, stop, value in unit:  # header bytes [start, stop) set to value
        ones[:, start:stop] = value
    return quants.dequantize(ones, qtype)


def decode_blocks(data: np.ndarray, qtype_name: str, n: int, k: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One GGUF tensor's bytes ([n, k] weights, rows of blocks) -> q [n, k] uint8, scales and
    zeros [n, k / group] float32 (module docstring)."""
    import gguf
    from gguf import quants

    qtype = gguf.GGMLQuantizationType[qtype_name]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    group = GGUF_PACKED_TYPES[qtype_name][1]
    b = np.ascontiguousarray(data).view(np.uint8).reshape(-1, type_size)  # [n_blocks, bytes]
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n_blocks, 1] (Q6_K: below)
    one, zero = _f16(1.0), _f16(0.0)
    if qtype_name == "Q8_0":
        q = _integers(b, qtype, (0, 2, one)) + 128
        scale, zero_point = d, np.full_like(d, 128.0)
    elif qtype_name == "Q4_0":
        q = _integers(b, qtype, (0, 2, one)) + 8
        scale, zero_point = d, np.full_like(d, 8.0)
    elif qtype_name == "Q4_1":
        m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        q = _integers(b, qtype, (0, 2, one), (2, 4, zero))
        scale, minimum = d, m  # w = scale * q + minimum
    elif qtype_name == "Q4_K":
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = quants.Q4_K.get_scale_min(b[:, 4:16].copy())  # [n_blocks, 8] each
        unit_scales = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=np.uint8)
        q = _integers(b, qtype, (0, 2, one), (2, 4, zero), (4, 16, unit_scales))
        scale = d * sc.astype(np.float32)  # [n_blocks, 8]
        minimum = -(dmin * mn.astype(np.float32))
    elif qtype_name == "Q6_K":
        d6 = b[:, 208:210].copy().view(np.float16).astype(np.float32)
        sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)  # [n_blocks, 16]
        q = _integers(b, qtype, (192, 208, np.ones(16, np.uint8)), (208, 210, one)) + 32
        scale, zero_point = d6 * sc, np.full_like(sc, 32.0)
    else:
        raise ValueError(f"{qtype_name}: not a GGML type kept packed")
    groups_per_block = block // group
    q = q.reshape(n, k)
    scale = np.broadcast_to(scale, (b.shape[0], groups_per_block)).reshape(n, k // group)
    if qtype_name in ("Q4_1", "Q4_K"):
        minimum = np.broadcast_to(minimum, (b.shape[0], groups_per_block)).reshape(n, k // group)
        constant = scale == 0  # w = minimum: stored as (0 - (-1)) * minimum
        with np.errstate(divide="ignore", invalid="ignore"):
            zero_point = np.where(constant, -1.0, -minimum / np.where(constant, 1.0, scale))
        if constant.any():
            q = np.where(np.repeat(constant, group, axis=1), 0.0, q)
            scale = np.where(constant, minimum, scale)
    else:
        zero_point = np.broadcast_to(zero_point, (b.shape[0], groups_per_block)
                                     ).reshape(n, k // group)
    return (torch.from_numpy(np.array(q, dtype=np.uint8)),
            torch.from_numpy(np.array(scale, dtype=np.float32)),
            torch.from_numpy(np.array(zero_point, dtype=np.float32)))


def _row_order(processor, name: str, n: int) -> np.ndarray | None:
    """The rows of the tensor transformers makes from GGUF tensor `name` as rows of the file's
    tensor (identity for most; llama's q/k un-permute), or None where the processor does more
    than reorder rows."""
    rows = np.arange(n, dtype=np.float64).reshape(n, 1)
    result = processor.process(weights=rows, name=name, tensor_key_mapping={},
                               parsed_parameters={"tensors": {}})
    out = np.asarray(result.weights).reshape(-1)
    if result.name != name or out.shape != (n,) or not np.array_equal(np.sort(out), rows[:, 0]):
        return None
    return out.astype(np.int64)


def repack_linears(path: Path, model: torch.nn.Module, reference: dict[str, torch.Tensor]
                   ) -> tuple[dict[str, dict[str, torch.Tensor]], RepackSummary]:
    """{hf linear prefix: its snapshot tensors (gguf_blocks.py)} for every tensor-parallel
    linear and vocabulary table (TABLES) the file stores in a packed type, and the summary of
    what was kept and dequantized.
    reference: transformers' float tensors by HF name (each repacked linear must equal its)."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    from shard.quantization.gguf_blocks import read_gguf_linear

    reader = gguf.GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor, model_type=arch)
    out: dict[str, dict[str, torch.Tensor]] = {}
    summary = RepackSummary()
    for tensor in reader.tensors:
        hf = names.get(tensor.name)
        qtype = tensor.tensor_type.name
        kind = None if hf is None or not hf.endswith(".weight") else hf.split(".")[-2]
        if kind not in LINEARS and kind not in TABLES:
            if qtype not in ("F32", "F16", "BF16"):
                summary.dequantized[qtype] += 1
            continue
        if qtype not in GGUF_PACKED_TYPES:
            if qtype not in ("F32", "F16", "BF16"):
                summary.dequantized[qtype] += 1
            continue
        k, n = (int(x) for x in tensor.shape[:2])  # GGUF lists the fastest dimension first
        order = _row_order(processor, tensor.name, n)
        if order is None:
            summary.dequantized[qtype] += 1
            continue
        q, scales, zeros = decode_blocks(tensor.data, qtype, n, k)
        q, scales, zeros = q[order], scales[order], zeros[order]
        bits = GGUF_PACKED_TYPES[qtype][0]
        parts = {
            "gguf_type": torch.tensor([int(tensor.tensor_type)], dtype=torch.int32),
            "qweight": (q[:, 0::2] | (q[:, 1::2] << 4)) if bits == 4 else q,
            "scales": _half_if_exact(scales),
            "zeros": _half_if_exact(zeros),
        }
        prefix = hf[: -len(".weight")]
        want = reference[hf].float()
        got = read_gguf_linear(prefix, {s: t.contiguous() for s, t in parts.items()}
                               ).dequantize(torch.float32)
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max())):
            raise ValueError(f"{path.name}: {tensor.name} ({qtype}) repacked differs from its "
                             "dequantized values (a tokenwire bug: report it)")
        out[prefix] = {s: t.contiguous() for s, t in parts.items()}
        (summary.tables if kind in TABLES else summary.packed)[qtype] += 1
    return out, summary
