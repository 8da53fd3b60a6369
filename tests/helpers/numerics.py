"""Numerical comparisons shared by the kernel and quantization tests."""

from __future__ import annotations

import torch


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error ||y - ref|| / ||ref|| (Frobenius), computed in fp32."""
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def agree_until_near_tie(got: list[list[int]], want: list[list[int]],
                         margins: list[list[float]], tie: float = 2e-2) -> None:
    """Each sequence's greedy tokens equal `want`'s up to (excluding) the first step where the
    reference's top-two logits were within `tie` (margins: per step, per sequence): Triton's fp32
    dots run as TF32 (about 1e-3 relative), and random tiny models have near-ties."""
    for seq, (g, w) in enumerate(zip(got, want, strict=True)):
        clear = next((i for i, step in enumerate(margins) if step[seq] < tie), len(w))
        assert g[:clear] == w[:clear], (seq, clear, g, w)
