"""Key rotation for fp8 KV caches (`--kv-cache-rotation`, on by default with an fp8 cache).

Why: attention scores are q·k, and the fp8 cache rounds each stored K element to e4m3's 3-bit
mantissa, an error roughly proportional to the element's size. Trained models concentrate q and
k in the same few large channels (rotary's low-frequency pairs), so the score error q·δk is
dominated by a handful of coordinates where both are large: its variance goes as
Σ_i q_i² k_i² ε², which is near (q·k)² ε² when both vectors share one outlier channel. Rotating
q and k by the same orthogonal matrix R leaves every score unchanged in exact arithmetic
((qR)·(kR) = q·k) and spreads each vector over all head_dim channels, so Σ_i q_i² k_i² drops
towards |q|²|k|²/head_dim: the same fp8 bytes carry a smaller score error. Measured on
SmolLM2-135M (benchmarks/QUALITY.md): Δ perplexity vs bf16 +1.85 % -> +0.79 %, mean KL 0.022 ->
0.0075 nats. V is left alone:
rotating V did not change the error there (the output is a weighted mean of V rows, which
averages each row's rounding instead of multiplying it with an aligned query).

R is the normalized Sylvester-Hadamard matrix when head_dim is a power of two (entries
±1/sqrt(head_dim), symmetric, R @ R = I), otherwise a fixed-seed random orthogonal matrix: the
same on every rank and every launch, so a prefix cached by one step is read correctly by the
next. Applied after rotary, to the query and the key of every step (the cache holds rotated keys).

Checkpoint KV scales (`k_scale`, as llm-compressor and `tokenwire quantize` write them) were
measured on unrotated keys, so a layer whose scales come from the checkpoint keeps its keys
unrotated (PagedAttention.load drops the rotation).
"""

from __future__ import annotations

import torch


def orthogonal_rotation(head_dim: int) -> torch.Tensor:  # [head_dim, head_dim] float32
    """R with R.T @ R = I: normalized Hadamard for powers of two, else a seeded random one."""
    if head_dim > 0 and head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < head_dim:  # Sylvester: H_2n = [[H, H], [H, -H]]
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h / head_dim**0.5
    generator = torch.Generator().manual_seed(0)
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64))
    # Fix QR's sign ambiguity so the matrix does not depend on the LAPACK build.
    return (q * torch.sign(torch.diagonal(r))).float()


def rotate_heads(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, head_dim] @ rotation [head_dim, head_dim] -> same shape, x's dtype."""
    return torch.matmul(x, rotation)
