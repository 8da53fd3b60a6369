"""Numerical comparisons shared by the kernel and quantization tests."""

from __future__ import annotations

import torch


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error ||y - ref|| / ||ref|| (Frobenius), computed in fp32."""
    return float((y.float() - ref.float()).norm() / ref.float().norm())
