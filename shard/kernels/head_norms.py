"""The per-head q/k RMSNorm a fused decode attention launch applies ahead of rotary (no Triton
here: the attention protocol names it on machines without a GPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadNorms:
    """Per-head RMSNorm of q and k (shard.layers.qk_norm.HeadRMSNorm's, with
    shard/kernels/qk_norm.py's rounding points), done inside the fused decode kernel."""

    q_weight: torch.Tensor  # [head_dim]
    k_weight: torch.Tensor  # [head_dim]
    eps: float
    offset: float = 0.0  # Gemma 3: the weight applied is (offset + w)
