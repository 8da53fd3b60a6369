"""LoRA adapters as the router sees them: which are loaded (on every shard), which generation of
a name is current (prefix-cache salt), and the errors of loading and naming them.

The registry is the router's record; the shards hold the weights. A name is admitted to requests
only between a load that succeeded on every rank and the start of its unload.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from service.engine.contracts import AdapterInfo, AdapterSource, EngineError

__all__ = [
    "AdapterExistsError",
    "AdapterInfo",
    "AdapterLoadError",
    "AdapterNotFoundError",
    "AdapterRegistry",
    "AdapterSource",
    "AdaptersDisabledError",
]


class AdapterNotFoundError(EngineError):
    """A request or an unload names an adapter that is not loaded (NOT_FOUND)."""


class AdapterLoadError(EngineError):
    """The shards refused an adapter; the message names it and the problem (INVALID_ARGUMENT)."""


class AdapterExistsError(EngineError):
    """An adapter of that name is already loaded (ALREADY_EXISTS)."""


class AdaptersDisabledError(EngineError):
    """The shards run without adapter slots (--max-loras 0) (FAILED_PRECONDITION)."""


@dataclass
class _Entry:
    info: AdapterInfo
    generation: int  # distinguishes a name's successive loads (their K/V never mix)
    unloading: bool = False


class AdapterRegistry:
    """Loaded adapters by name. Plain Python; the engine owns one."""

    def __init__(self, max_loras: int, max_lora_rank: int, base_model_id: str = "") -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.base_model_id = base_model_id
        self._entries: dict[str, _Entry] = {}
        self._generations = itertools.count(1)

    def list(self) -> list[AdapterInfo]:
        """Adapters requests may use, in load order."""
        return [e.info for e in self._entries.values() if not e.unloading]

    def names(self) -> list[str]:
        return [i.name for i in self.list()]

    def add(self, info: AdapterInfo) -> None:
        self._entries[info.name] = _Entry(info, next(self._generations))

    def remove(self, name: str) -> None:
        self._entries.pop(name, None)

    def contains(self, name: str) -> bool:
        """True when the name is known at all (also while it unloads)."""
        return name in self._entries

    def begin_unload(self, name: str) -> None:
        entry = self._entries.get(name)
        if entry is None or entry.unloading:
            raise AdapterNotFoundError(f"adapter '{name}' is not loaded")
        entry.unloading = True

    def cancel_unload(self, name: str) -> None:
        entry = self._entries.get(name)
        if entry is not None:
            entry.unloading = False

    def cache_salt(self, name: str) -> bytes:
        """The prefix-cache root of a request with this adapter (raises AdapterNotFoundError
        when the adapter is not usable): blocks computed with one adapter, or one load of it,
        are never served to another."""
        entry = self._entries.get(name)
        if entry is None or entry.unloading:
            raise AdapterNotFoundError(self.not_found_message(name))
        return f"lora:{entry.generation}:{name}".encode()

    def not_found_message(self, name: str) -> str:
        loaded = ", ".join(f"'{n}'" for n in self.names()) or "none"
        return f"adapter '{name}' is not loaded (loaded adapters: {loaded})"

    def check_new(self, source: AdapterSource) -> None:
        if source.name in self._entries:
            raise AdapterExistsError(f"adapter '{source.name}' is already loaded; unload it first")
        if self.base_model_id and source.name == self.base_model_id:
            raise AdapterLoadError(
                f"adapter name '{source.name}' is the base model's id; choose another name"
            )
        if self.max_loras == 0:
            raise AdaptersDisabledError(
                "LoRA adapters are off: start the shards with --max-loras N (adapter slots are "
                "reserved before the KV cache is sized)"
            )
