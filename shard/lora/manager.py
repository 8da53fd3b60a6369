"""The adapters of one rank: every loaded adapter in host memory, up to --max-loras of them
resident in the device slots (swapped in least-recently-used first when a step needs one).

Threads: `read` (file I/O, validation, slicing) runs on any thread and touches no shared state;
`register`, `unregister` and `slots_for` run on the model worker thread, between steps, so a
slot is never rewritten under a running forward pass.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shard.errors import FailedPreconditionError, NotFoundError
from shard.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from shard.layers.lora import LoraBatch, LoraPart, LoraWeights
from shard.lora.adapter import (
    SUPPORTED_TARGETS,
    AdapterFacts,
    AdapterLoadError,
    AdapterSource,
    HostAdapter,
    read_adapter,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraLimits:
    """--max-loras (device slots) and --max-lora-rank (largest rank a slot holds)."""

    max_loras: int
    max_lora_rank: int

    def __post_init__(self) -> None:
        if self.max_loras < 0:
            raise ValueError(f"--max-loras must be >= 0; got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1; got {self.max_lora_rank}")


class AdapterExistsError(FailedPreconditionError):
    """An adapter of that name is already loaded."""


class LoraManager:
    def __init__(self, layers: list[LoraWeights], batch: LoraBatch, limits: LoraLimits,
                 dtype: torch.dtype, pin: bool):
        self.layers = layers
        self.batch = batch
        self.limits = limits
        self.dtype = dtype
        self.pin = pin  # page-locked host copies: swap-ins copy asynchronously (CUDA)
        # checkpoint module name -> (its LoraWeights, part index, part)
        self.targets: dict[str, tuple[LoraWeights, int, LoraPart]] = {
            part.name: (w, i, part) for w in layers for i, part in enumerate(w.parts)
        }
        self.adapters: dict[str, HostAdapter] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recent first
        self.free_slots = list(range(limits.max_loras - 1, -1, -1))
        self.swap_ins = 0

    def device_bytes(self) -> int:
        return sum(w.nbytes() for w in self.layers)

    # ---- any thread ---------------------------------------------------------------------------

    def read(self, source: AdapterSource) -> HostAdapter:
        """Reads and validates an adapter (no shared state touched)."""
        parts = {name: part for name, (_, _, part) in self.targets.items()}
        return read_adapter(source, parts, self.limits.max_lora_rank, self.dtype, self.pin)

    # ---- model worker thread ------------------------------------------------------------------

    def register(self, adapter: HostAdapter) -> AdapterFacts:
        name = adapter.facts.name
        if name in self.adapters:
            raise AdapterExistsError(f"adapter '{name}' is already loaded; unload it first")
        self.adapters[name] = adapter
        log.info("adapter %s loaded from %s: rank %d, alpha %g, %s (%.1f MiB on the host)",
                 name, adapter.facts.source, adapter.facts.rank, adapter.facts.alpha,
                 ",".join(adapter.facts.target_modules), adapter.nbytes() / 2**20)
        return adapter.facts

    def unregister(self, name: str, in_use: set[str]) -> None:
        if name not in self.adapters:
            raise NotFoundError(f"adapter '{name}' is not loaded")
        if name in in_use:
            raise FailedPreconditionError(
                f"adapter '{name}' is used by requests on this shard; they must finish first"
            )
        del self.adapters[name]
        slot = self.resident.pop(name, None)
        if slot is not None:
            self.free_slots.append(slot)
        log.info("adapter %s unloaded", name)

    def has(self, name: str) -> bool:
        return name in self.adapters

    def facts(self) -> list[AdapterFacts]:
        return [a.facts for a in self.adapters.values()]

    def slots_for(self, names: list[str], in_use: Callable[[], set[str]]) -> list[int]:
        """The device slot of each name ("" -> -1, the base model), swapping adapters in as
        needed; `in_use()` names the adapters of requests on this rank, which are never evicted.
        The router admits at most --max-loras distinct adapters at once, so a slot is found."""
        out: list[int] = []
        for name in names:
            if not name:
                out.append(-1)
                continue
            slot = self.resident.get(name)
            if slot is None:
                slot = self._swap_in(name, in_use())
            else:
                self.resident.move_to_end(name)
            out.append(slot)
        return out

    def _swap_in(self, name: str, in_use: set[str]) -> int:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise NotFoundError(f"adapter '{name}' is not loaded")
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((n for n in self.resident if n not in in_use or n == name), None)
            if victim is None:
                raise FailedPreconditionError(
                    f"adapter '{name}': all {self.limits.max_loras} device slots hold adapters "
                    f"of running requests (--max-loras)"
                )
            slot = self.resident.pop(victim)
        for w in self.layers:
            w.write_slot(slot, [adapter.tensors.get(part.name) for part in w.parts])
        self.resident[name] = slot
        self.swap_ins += 1
        return slot


def attach_lora(model: nn.Module, limits: LoraLimits, device: torch.device, dtype: torch.dtype
                ) -> LoraManager:
    """Gives every adaptable linear of `model` its stacked slot buffers (allocated now, before
    warmup sizes the KV cache from the memory left) and returns the manager of them."""
    batch = LoraBatch(limits.max_loras)
    layers: list[LoraWeights] = []
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0]
        if isinstance(module, MergedColumnParallelLinear):
            parts, offset = [], 0
            for pname, col in module.parts.items():
                if pname not in SUPPORTED_TARGETS:
                    break
                index, count = col.part
                start = index * col.out_local
                parts.append(LoraPart(
                    f"{parent}.{pname}" if parent else pname, col.in_features,
                    col.out_local * count, (0, col.in_features),
                    (start, start + col.out_local), offset,
                ))  # fmt: skip
                offset += col.out_local
            else:
                w = LoraWeights(parts, batch, limits.max_lora_rank, device, dtype)
                module.attach_lora(w)  # folds the A matrices into the weight where it can
                layers.append(w)
        elif isinstance(module, RowParallelLinear) and name.rpartition(".")[2] in SUPPORTED_TARGETS:
            rank, world = module.dist.rank, module.dist.world_size
            local = module.in_features // world
            part = LoraPart(name, module.in_features, module.out_features,
                            (rank * local, (rank + 1) * local), (0, module.out_features), 0)
            w = LoraWeights([part], batch, limits.max_lora_rank, device, dtype)
            module.attach_lora(w)
            layers.append(w)
    if not layers:
        raise AdapterLoadError("the model has no projections LoRA adapters can target")
    manager = LoraManager(layers, batch, limits, dtype, pin=device.type == "cuda")
    log.info("LoRA: %d adapter slots of rank <= %d on %d layers (A folded into the base "
             "weight on %d): %.1f MiB on the device", limits.max_loras, limits.max_lora_rank,
             len(layers), sum(w.folded is not None for w in layers),
             manager.device_bytes() / 2**20)
    return manager
