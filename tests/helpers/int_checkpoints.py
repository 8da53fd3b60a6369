"""Test-side writers of GPTQ (v1), AWQ (GEMM) and compressed-tensors pack-quantized / int-quantized checkpoints, written from the formats'
published descriptions independently of shard/quantization/int_weights.py (which reads them), and
the reference each is checked against: the same integers dequantized here, stored as a plain
float32 checkpoint.

Layouts written (K input features, N output features, G groups):
- GPTQ v1: `qweight` int32 [K * bits / 32, N], input feature 32/bits * r + i of column n in bits
  [i*bits, (i+1)*bits) of word [r, n]; `qzeros` int32 [G, N * bits / 32] packed the same way along
  the output features, holding zero - 1; `scales` fp16 [G, N]; `g_idx` int32 [K].
- AWQ GEMM: `qweight` int32 [K, N / 8], output feature 8c + ORDER[i] in nibble i of word [k, c]
  with ORDER = (0, 2, 4, 6, 1, 3, 5, 7); `qzeros` int32 [G, N / 8] alike (zero points as they
  are); `scales` fp16 [G, N].
- compressed-tensors pack-quantized: `weight_packed` int32 [N, K * bits / 32] (input feature
  32/bits * c + i in bits [i*bits, ...) of word c), values = signed integer + 2^(bits-1);
  `weight_scale` [N, G]; `weight_zero_point` int32 [N * bits / 32, G] packed along the output
  rows with the same offset (asymmetric only); `weight_shape` [N, K]; `weight_g_idx` [K].
- compressed-tensors int-quantized (W8A8-int8): `weight` int8 [N, K] (signed values),
  `weight_scale` [N, 1]; the activations' per-token scales are computed at run time.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from shard.distributed.groups import Dist

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class IntSpec:
    layout: str  # "gptq" | "awq" | "ct" (compressed-tensors pack-quantized) | "w8a8" (int-quantized)
    bits: int
    group_size: int  # -1: one group per output channel
    sym: bool
    desc_act: bool = False

    @property
    def name(self) -> str:
        order = "-act" if self.desc_act else ""
        return f"{self.layout}-w{self.bits}-g{self.group_size}-{'sym' if self.sym else 'asym'}{order}"


def quantize(w: torch.Tensor, spec: IntSpec, seed: int) -> dict[str, torch.Tensor]:
    """w [N, K] float -> q [N, K] int64, scales [G, N] fp16, zeros [G, N] int64, g_idx [K]; the
    groups follow a random column order when desc_act (act-order's effect on the layout)."""
    n, k = w.shape
    size = k if spec.group_size == -1 else spec.group_size
    groups = k // size
    if spec.desc_act:
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // size
    else:
        g_idx = torch.arange(k) // size
    top = 2**spec.bits - 1
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g].float()  # [N, size]
        if spec.sym:
            s = cols.abs().amax(dim=1).clamp(min=1e-8) / (2 ** (spec.bits - 1) - 1)
            z = torch.full((n,), 2 ** (spec.bits - 1), dtype=torch.int64)
        else:
            lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            s = ((hi - lo) / top).clamp(min=1e-8)
            # >= 1: GPTQ v1 stores zero - 1 in `bits` bits, so a zero point of 0 cannot be stored.
            z = (-lo / s).round().long().clamp(1, top)
        scales[g], zeros[g] = s, z
    scales = scales.half()
    g = g_idx
    q = (w.float() / scales.float().t()[:, g]).round().long() + zeros.t()[:, g]
    return {"q": q.clamp(0, top), "scales": scales, "zeros": zeros, "g_idx": g_idx}


def dequantize(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """[N, K] float32: (q - zero) * scale of each weight's group."""
    g = parts["g_idx"]
    return (parts["q"] - parts["zeros"].t()[:, g]).float() * parts["scales"].float().t()[:, g]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] ints -> [R * bits / 32, C] int32: row (32/bits) * r + i in bits [i*bits, ...)."""
    per = 32 // bits
    v = values.reshape(-1, per, values.shape[1])
    words = sum(v[:, i] << (bits * i) for i in range(per))
    return _to_int32(words)


def pack_columns(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
                 ) -> torch.Tensor:
    """[R, C] ints -> [R, C * bits / 32] int32: column (32/bits) * c + order[i] in bits
    [i*bits, ...) of word c (order: identity unless given)."""
    per = 32 // bits
    order = order or tuple(range(per))
    v = values.reshape(values.shape[0], -1, per)
    words = sum(v[:, :, order[i]] << (bits * i) for i in range(per))
    return _to_int32(words)


def pack(parts: dict[str, torch.Tensor], spec: IntSpec) -> dict[str, torch.Tensor]:
    """The layer's checkpoint tensors (suffix -> tensor) in spec.layout."""
    q_kn = parts["q"].t().contiguous()  # [K, N]
    if spec.layout == "gptq":
        return {
            "qweight": pack_rows(q_kn, spec.bits),
            "qzeros": pack_columns(parts["zeros"] - 1, spec.bits),
            "scales": parts["scales"],
            "g_idx": parts["g_idx"].to(torch.int32),
        }
    if spec.layout == "ct":
        # values and zero points are the signed integers + 2^(bits-1): exactly the unsigned
        # integers written here (symmetric: zero 2^(bits-1), i.e. signed 0, not stored)
        out = {
            "weight_packed": pack_columns(parts["q"], spec.bits),
            "weight_scale": parts["scales"].t().contiguous(),
            "weight_shape": torch.tensor(list(parts["q"].shape)),
        }
        if not spec.sym:
            out["weight_zero_point"] = pack_rows(parts["zeros"].t().contiguous(), spec.bits)
        if spec.desc_act:
            out["weight_g_idx"] = parts["g_idx"].to(torch.int32)
        return out
    if spec.layout == "w8a8":
        # int-quantized: the signed int8 values as they are, one scale per output channel
        assert spec.bits == 8 and spec.sym and spec.group_size == -1
        return {"weight": (parts["q"] - parts["zeros"].t()).to(torch.int8),
                "weight_scale": parts["scales"].t().contiguous()}  # [N, 1]
    assert spec.layout == "awq" and spec.bits == 4 and not spec.desc_act
    return {
        "qweight": pack_columns(q_kn, 4, AWQ_PACK_ORDER),
        "qzeros": pack_columns(parts["zeros"], 4, AWQ_PACK_ORDER),
        "scales": parts["scales"],
    }


def quantization_config(spec: IntSpec) -> dict:
    if spec.layout == "gptq":
        return {"quant_method": "gptq", "bits": spec.bits, "group_size": spec.group_size,
                "desc_act": spec.desc_act, "sym": spec.sym, "checkpoint_format": "gptq"}
    if spec.layout == "w8a8":
        return {"quant_method": "compressed-tensors", "format": "int-quantized",
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                "strategy": "channel", "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                          "strategy": "token", "dynamic": True}}},
                "ignore": ["lm_head"]}
    if spec.layout == "ct":
        weights = {"num_bits": spec.bits, "type": "int", "symmetric": spec.sym,
                   "strategy": "channel" if spec.group_size == -1 else "group",
                   "group_size": None if spec.group_size == -1 else spec.group_size,
                   "actorder": "group" if spec.desc_act else None}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": None}},
                "ignore": ["lm_head"]}
    return {"quant_method": "awq", "bits": 4, "group_size": spec.group_size,
            "zero_point": not spec.sym, "version": "gemm"}


def write_int_checkpoint(src: Path, dst: Path, spec: IntSpec, tables: tuple[str, ...] = ()
                         ) -> Path:
    """Copies the tiny model at src to dst with every TP linear stored in spec's format, and to
    dst-dequantized with the same integers dequantized here (float32); returns the latter.
    tables: vocabulary tables ("lm_head", "embed_tokens") quantized too (compressed-tensors:
    no longer in the config's ignore list)."""
    shutil.copytree(src, dst)
    ref = dst.parent / (dst.name + "-dequantized")
    shutil.copytree(src, ref)
    tensors = load_file(str(src / "model.safetensors"))
    packed, plain = {}, {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        if name.endswith(".weight") and name.split(".")[-2] in (*LINEARS, *tables):
            parts = quantize(t, spec, seed=i)
            prefix = name[: -len(".weight")]
            for suffix, value in pack(parts, spec).items():
                packed[f"{prefix}.{suffix}"] = value
            plain[name] = dequantize(parts)
        else:
            packed[name] = plain[name] = t
    save_file(packed, str(dst / "model.safetensors"))
    save_file(plain, str(ref / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config(spec)
    if "lm_head" in tables:
        config["quantization_config"]["ignore"] = []
    (dst / "config.json").write_text(json.dumps(config))
    return ref


# Greedy steps of the two-rank check: enough to cover prefill and decode through every packed
# linear; fewer than the 32 of shard.testing.tiny keeps the test's CPU cost down.
GREEDY_STEPS = 12


def short_greedy_rank(dist: Dist, device: str, job: dict[str, Any], res: dict[str, Any]) -> None:
    """A run_ranks rank function: job["tiny_dirs"] {name: dir} -> res["tiny_tokens"][name], the
    greedy tokens of GREEDY_STEPS steps (module level: the spawned ranks import it by name)."""
    from shard.testing.tiny import greedy_tokens, load_tiny

    for name, model_dir in job["tiny_dirs"].items():
        shard = load_tiny(Path(model_dir), device, dist)
        res.setdefault("tiny_tokens", {})[name] = greedy_tokens(shard, GREEDY_STEPS)
