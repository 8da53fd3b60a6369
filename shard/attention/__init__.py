"""Attention behind one interface: a portable torch backend (CPU and CUDA) and GPU kernels.

`get_backend(name, device)` is the one place a backend is chosen; GPU backends register a factory
in `backend_factories()` (imported lazily so CPU installs never import Triton).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shard.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "backend_factories", "get_backend"]


def _torch_backend() -> AttentionBackend:
    from shard.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def _triton_backend() -> AttentionBackend:
    from shard.attention.cuda_backend import CudaAttentionBackend

    return CudaAttentionBackend()


def backend_factories() -> dict[str, Callable[[], AttentionBackend]]:
    """name -> factory of every known backend."""
    return {"torch": _torch_backend, "triton": _triton_backend}


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """Backend by name; "auto" picks triton on CUDA when it imports, torch otherwise."""
    factories = backend_factories()
    if name == "auto":
        if device.type == "cuda":
            try:
                return factories["triton"]()
            except ImportError:
                pass
        return factories["torch"]()
    if name not in factories:
        raise ValueError(f"--attention-backend must be one of auto, {', '.join(factories)}")
    return factories[name]()
