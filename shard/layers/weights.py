"""Memory-mapped safetensors weights; each rank reads only its slice.

`safe_open` maps the files; `get_slice` reads just the requested rows/columns, so a rank of an
N-way tensor-parallel deployment touches about 1/N of each sharded matrix.
"""

from __future__ import annotations

import abc
import copy
import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shard.distributed.groups import Dist
from shard.quantization.loading import LinearQuantization

log = logging.getLogger(__name__)
# Seconds between "weights: i/n" progress lines while a model loads (a 70B rank takes minutes).
PROGRESS_EVERY_S = 10.0


class Weights:
    """Tensor name -> file index over a checkpoint directory (single file or sharded index)."""

    def __init__(
        self,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        dist: Dist,
        quant: LinearQuantization | None = None,
    ):
        self.device = device
        self.dtype = dtype
        self.dist = dist
        # How the tensor-parallel linears quantize what they load (None: dense).
        self.quant = quant
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where: dict[str, int] = {}
        for i, handle in enumerate(self._handles):
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                self._where[name] = i

    def has(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def _slice(self, name: str):
        if name not in self._where:
            raise KeyError(f"weight {name!r} not found in the checkpoint")
        return self._handles[self._where[name]].get_slice(name)

    def _finish(self, t: torch.Tensor) -> torch.Tensor:
        """The slice read from the file (host memory, freed on return) on the device, in the
        serving dtype. Device first: a dtype change (an fp32 or fp16 checkpoint served in bf16)
        then runs on the GPU instead of one host core, and the host holds one copy, not two."""
        t = t.to(self.device)
        return t.to(self.dtype) if t.is_floating_point() else t

    def get(self, name: str, raw: bool = False) -> torch.Tensor:
        """The whole tensor (replicated weights: norms, biases of row-parallel layers); raw keeps
        the stored dtype (fp8 scales)."""
        if raw:
            self._slice(name)  # the clear KeyError for a missing name
            return self._handles[self._where[name]].get_tensor(name).to(self.device)
        return self._finish(self._slice(name)[:])

    def get_sharded(self, name: str, dim: int) -> torch.Tensor:
        """This rank's contiguous 1/world_size part of the tensor along dim (0 or 1)."""
        sl = self._slice(name)
        size = sl.get_shape()[dim]
        world, rank = self.dist.world_size, self.dist.rank
        if size % world:
            raise ValueError(f"{name}: dim {dim} of size {size} is not divisible by {world} ranks")
        block = size // world
        start, stop = rank * block, (rank + 1) * block
        t = sl[start:stop] if dim == 0 else sl[:, start:stop]
        return self._finish(t)

    def for_part(self, index: int, count: int) -> Weights:
        """These weights with get_sharded (and fp8 scale slicing) cutting tensors into count
        parts and reading part index, instead of (rank, world_size): layers whose rows are not
        split by rank, such as replicated KV heads. Shares the open files."""
        if (index, count) == (self.dist.rank, self.dist.world_size):
            return self
        view = copy.copy(self)
        view.dist = Dist(rank=index, world_size=count)
        return view

    def get_part(self, name: str, index: int, dim: int, start: int, stop: int) -> torch.Tensor:
        """tensor[index] sliced to [start, stop) along dim (0 or 1) of what remains: one expert's
        rows or columns of a 3-D stacked-experts tensor, nothing else read."""
        sl = self._slice(name)
        return self._finish(sl[index, start:stop] if dim == 0 else sl[index, :, start:stop])

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along dim 0 (vocab-parallel embeddings with padding)."""
        return self._finish(self._slice(name)[start:stop])


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


class WeightLoader(abc.ABC):
    """A layer that reads its own tensors (its slice of them, under tensor parallelism) from a
    checkpoint; mixed into the nn.Module layers. A loader owns its whole subtree: its children
    are loaded by it, not visited on their own."""

    @abc.abstractmethod
    def load(self, weights: Weights, prefix: str) -> None:
        """Reads the tensors named `{prefix}.<name>` (prefix: the module's checkpoint name)."""


def load_module_weights(root: nn.Module, weights: Weights, skip: frozenset[str] = frozenset()
                        ) -> None:
    """Calls `load(weights, name)` on every WeightLoader below root, outermost first (module
    names equal the checkpoint's tensor prefixes); the modules named in `skip` and everything
    under a loader are left to their owner."""
    owned: list[str] = []  # prefixes of loaders already called: their subtrees are theirs
    modules = list(root.named_modules())  # loaders add modules (quantized parts)
    total = sum(isinstance(m, WeightLoader) for _, m in modules)
    t0 = last = time.monotonic()
    done = 0
    for name, module in modules:
        if module is root or any(name.startswith(p + ".") for p in owned):
            continue
        if isinstance(module, WeightLoader):
            owned.append(name)
            if name not in skip:
                module.load(weights, name)
            done += 1
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                last = time.monotonic()
                log.info("weights: %d/%d layers' loaders done (%s) in %.0f s", done, total,
                         name, last - t0)
    log.info("weights: loaded in %.1f s (%s of parameters on %s)", time.monotonic() - t0,
             size_text(parameter_bytes(root)), weights.device)


def size_text(n: int) -> str:
    """Bytes as GiB from 1 GiB up, else MiB (log lines)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def parameter_bytes(root: nn.Module) -> int:
    """Bytes of root's parameters and buffers, each storage counted once (tied and merged
    weights are views)."""
    seen: set[int] = set()
    total = 0
    for t in [*root.parameters(), *root.buffers()]:
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
