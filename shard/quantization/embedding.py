"""Token embedding and LM head kept in the checkpoint's own integer form (any family whose
embedding / LM head are shard.layers.embedding's vocabulary-sliced layers).

A [vocab, hidden] table stored quantized (a GGUF snapshot's Q8_0 / Q4_* token embedding kept
packed by shard/tools/gguf_repack.py, a compressed-tensors `pack-quantized` lm_head /
embed_tokens, a GPTQ / AWQ lm_head) is read as the linears are (int_weights.UnpackedInt:
vocabulary rows are the output features N, hidden the input features K), this rank's vocabulary
rows taken and padded, and repacked into the shard's one int layout (int_weights.PackedInt)
inside an IntLinear:
- the LM head is that IntLinear: logits = hidden @ W.T (on CUDA its int GEMV / dequant-fused
  GEMM, on CPU the weight dequantized per matmul, as every packed linear);
- the lookup gathers the ids' packed rows, scales and zeros ([n, K/2] or [n, K] bytes) and
  dequantizes only those rows, in float32 and then the model dtype: the same values the
  checkpoint's own dequantization gives, nothing of the table expanded;
- a tied head shares the embedding's IntLinear (one copy of the table).
Padding rows (the vocabulary rounded up to a multiple of the ranks) are zeros (q 0, scale 0,
zero 0: a zero row, as the float layers pad).
"""

from __future__ import annotations

import torch

from shard.quantization.int_weights import IntLinear, PackedInt, UnpackedInt, read_unpacked
from shard.quantization.loading import WeightSource
from shard.quantization.methods import IntLayout, IntWeightFormat


def stored_int_rows(weights: WeightSource, prefix: str) -> bool:
    """Whether the checkpoint stores `{prefix}`'s table in an integer form this module reads;
    ValueError for one it stores quantized in a form it does not (rather than reading the
    integers as float weights)."""
    fmt = _format(weights)
    if fmt is None:
        return False
    if fmt.layout not in _KEYS:
        if weights.has(f"{prefix}.weight_scale"):
            raise ValueError(f"{prefix}.weight_scale: {fmt.layout.value} vocabulary tables are "
                             "not supported (supported: pack-quantized, GPTQ, AWQ, GGUF)")
        return False
    return weights.has(f"{prefix}.{_KEYS[fmt.layout]}")


# The tensor that marks a table stored quantized, by layout (int-quantized W8A8: not read).
_KEYS = {IntLayout.GGUF: "qweight", IntLayout.PACK_QUANTIZED: "weight_packed",
         IntLayout.GPTQ: "qweight", IntLayout.AWQ: "qweight"}


def _format(weights: WeightSource) -> IntWeightFormat | None:
    quant = getattr(weights, "quant", None)
    return None if quant is None else quant.packed


def load_int_rows(weights: WeightSource, prefix: str, start: int, stop: int, per_rank: int
                  ) -> IntLinear:
    """Vocabulary rows [start, stop) of the stored integer table `{prefix}` (zero rows after them
    up to per_rank) as an IntLinear [per_rank, hidden]."""
    fmt = _format(weights)
    if fmt is None or fmt.layout not in _KEYS:
        raise ValueError(f"{prefix}: the checkpoint stores no integer table here")
    stored = {suffix: weights.get(f"{prefix}.{suffix}", raw=True)
              for suffix in fmt.layout.tensor_names if weights.has(f"{prefix}.{suffix}")}
    if fmt.layout is IntLayout.GGUF:
        from shard.quantization.gguf_blocks import read_gguf_linear

        full = read_gguf_linear(prefix, stored)
    else:
        full = read_unpacked(fmt, prefix, stored)
    vocab = full.q.shape[0]
    if stop > vocab:
        raise ValueError(f"{prefix}: {vocab} stored rows, the config's vocabulary needs {stop}")
    rows = full.rows(start, stop)
    del full, stored
    pad = per_rank - rows.q.shape[0]
    if pad:
        def padded(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(pad, *t.shape[1:])])

        rows = UnpackedInt(padded(rows.q), padded(rows.scales), padded(rows.zeros), rows.g_idx,
                           rows.bits)
    return IntLinear(PackedInt.pack(rows))


def lookup_rows(table: IntLinear, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """table's rows `ids` ([n] in [0, rows)) dequantized: [n, hidden] in dtype (computed in
    float32, as IntLinear's own dequantization)."""
    rows = PackedInt(table.qweight.index_select(0, ids), table.scales.index_select(0, ids),
                     table.zeros.index_select(0, ids), table.bits, table.in_features,
                     table.group_size, table.perm, table.g_idx).dequantize(dtype)  # storage order
    if table.perm is None:
        return rows
    out = torch.empty_like(rows)
    out[:, table.perm.long()] = rows  # storage column k holds input feature perm[k]
    return out
