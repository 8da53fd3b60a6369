"""Rotary position embeddings (NeoX "rotate half" layout) with the rope_type variants we support."""

from __future__ import annotations

import math

import torch

from shard.attention.base import AttentionMetadata


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths divided by factor, short kept,
    a smooth blend in between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _default(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    return inv_freq


def _linear(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    return inv_freq / params["factor"]


# rope_type -> inverse-frequency transform
ROPE_TYPES = {"default": _default, "linear": _linear, "llama3": _llama3_inv_freq}
# LongRoPE (Phi-3 / Phi-3.5 / Phi-4 "longrope", formerly "su"): per-frequency rescale factors,
# short for sequences up to original_max_position_embeddings, long for longer ones, and cos/sin
# scaled by an attention factor. Built as whole tables by _longrope_tables.
LONGROPE_TYPES = ("longrope", "su")


def _longrope_tables(
    head_dim: int, max_positions: int, params: dict
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """cos, sin [original + max_positions, head_dim] float32 and original: rows [0, original)
    rotate positions 0.. with the short factors, rows [original, original + max_positions)
    positions 0.. with the long factors (RotaryEmbedding.table_rows picks per sequence). cos
    and sin are multiplied by the attention factor, default sqrt(1 + ln(factor) / ln(original))
    with factor = max / original positions."""
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or params["max_position_embeddings"] / original
    scale = params.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    base = float(params["rope_theta"])
    rows = []
    for key, count in (("short_factor", original), ("long_factor", max_positions)):
        ext = torch.tensor(params[key], dtype=torch.float32)  # [head_dim / 2]
        if ext.numel() != head_dim // 2:
            raise ValueError(f"rope_scaling.{key} has {ext.numel()} values; the model's "
                             f"head_dim {head_dim} needs {head_dim // 2}")
        inv_freq = 1.0 / (ext * base**exps)
        t = torch.arange(count, dtype=torch.float32)
        rows.append(torch.outer(t, inv_freq))  # [count, head_dim / 2]
    freqs = torch.cat(rows)  # [original + max_positions, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [original + max_positions, head_dim]
    return emb.cos() * scale, emb.sin() * scale, original


def rope_parameters(config: dict, layer_type: str | None = None) -> dict:
    """rope_theta and rope_type from a config dict, old (rope_scaling) or new (rope_parameters).

    layer_type ("sliding_attention" / "full_attention"): models whose local and global layers
    rotate with their own bases (Gemma 3) give per-type parameters, new style as
    rope_parameters[layer_type], old style as rope_local_base_freq (local layers, unscaled)
    beside rope_theta + rope_scaling (global layers)."""
    raw = config.get("rope_parameters") or {}
    if layer_type is not None and isinstance(raw.get(layer_type), dict):
        params = dict(raw[layer_type])
    elif layer_type == "sliding_attention" and config.get("rope_local_base_freq") is not None:
        return {"rope_theta": float(config["rope_local_base_freq"]), "rope_type": "default"}
    else:
        # (a per-type dict without this type: the flat fields below)
        params = {k: v for k, v in raw.items() if not isinstance(v, dict)}
        params.update(config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    for key in ("original_max_position_embeddings", "max_position_embeddings"):  # LongRoPE
        if key in config:
            params.setdefault(key, config[key])
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position up to max_positions, looked up per token."""

    def __init__(self, head_dim: int, max_positions: int, params: dict, device: torch.device):
        super().__init__()
        rope_type = params["rope_type"]
        # LongRoPE: the row where the long-factor rows start (see table_rows); None otherwise.
        self.long_rows: int | None = None
        if rope_type in LONGROPE_TYPES:
            cos, sin, self.long_rows = _longrope_tables(head_dim, max_positions, params)
        elif rope_type in ROPE_TYPES:
            base = float(params["rope_theta"])
            exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            inv_freq = ROPE_TYPES[rope_type](1.0 / (base**exps), params)  # [head_dim / 2]
            t = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim / 2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
            cos, sin = emb.cos(), emb.sin()
        else:
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported")
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)
        # (positions tensor, its version, dtype, cos, signed sin) of the last lookup; see _lookup.
        self._last_lookup: tuple[torch.Tensor, int, torch.dtype, torch.Tensor, torch.Tensor] | None = (
            None
        )

    def table_rows(self, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The cos/sin rows the step's tokens read ([num_tokens] int64; the model passes them to
        the attention layers in place of the positions): the positions, except under LongRoPE,
        where a sequence longer than original_max_position_embeddings (its length this step)
        reads the long-factor rows. transformers decides alike from the sequence length; it
        also recomputes the cached keys when a sequence grows past that length, which a paged
        cache does not: keys cached before the switch keep the short factors."""
        if self.long_rows is None:
            return positions
        if meta.is_decode_only and positions.shape[0] == meta.seq_lens.shape[0]:
            seq_lens = meta.seq_lens  # one token per sequence (decode graphs too)
        else:  # [num_tokens]: each token's sequence length
            seq_lens = torch.repeat_interleave(meta.seq_lens, meta.query_start_loc.diff(),
                                               output_size=positions.shape[0])
        return positions + self.long_rows * (seq_lens > self.long_rows)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64, rows of the tables (see table_rows)
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.is_cuda and q.stride(-1) == 1 and k.stride(-1) == 1:  # one fused kernel
            from shard.kernels.elementwise import rotary

            return rotary(positions, q, k, self.cos, self.sin)
        cos, signed_sin = self._lookup(positions, q.dtype)
        return _rotate(q, cos, signed_sin), _rotate(k, cos, signed_sin)

    def _lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # each [num_tokens, 1, head_dim] in dtype
        """cos and sign-folded sin rows of these positions. Every layer of a step passes the same
        positions tensor, so the lookup is done once per step and reused by the other layers
        (on CPU the per-layer gathers and casts were a measurable share of a decode step)."""
        # _version: bumped by in-place writes. Tensors made under torch.inference_mode() keep
        # no version counter, so their lookups are not cached (-1: never matches).
        version = -1 if positions.is_inference() else positions._version
        key = (positions, version, dtype)
        cached = self._last_lookup
        if cached is not None and version >= 0 and cached[0] is positions and cached[1:3] == key[1:]:
            return cached[3], cached[4]
        half = self.cos.shape[-1] // 2
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1)
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: the sign folded into the
        # table (exact: negating before or after the product rounds alike).
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).to(dtype)
        self._last_lookup = (*key, cos, signed)
        return cos, signed


def _rotate(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]
    signed_sin: torch.Tensor,  # [num_tokens, 1, head_dim]
) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x_hi, x_lo) written as a roll
    of x times the sign-folded sin: 4 ops instead of 7."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
