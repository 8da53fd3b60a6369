"""The bounded in-memory store behind OpenAI Responses' `previous_response_id` and
`GET`/`DELETE /v1/responses/{id}`: at most `max_entries` responses, each kept at most
`ttl_seconds` after it was stored; the least recently stored (or read) goes first when full.

Plain Python, one per router process (with `--frontends N >= 2` each front end keeps its own,
so a follow-up that lands on another front end does not find its predecessor: 404). Evictions
are counted by reason through `on_evict` (Prometheus: `tokenwire_responses_store_evictions_total`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

_V = TypeVar("_V")

EVICT_SIZE = "size"  # pushed out by a newer response when full
EVICT_TTL = "ttl"  # older than ttl_seconds when looked at


@dataclass(frozen=True)
class _Entry(Generic[_V]):
    value: _V
    stored_at: float  # monotonic seconds


class ResponseStore(Generic[_V]):
    """An LRU map id -> value with a size bound and a time to live."""

    def __init__(
        self,
        max_entries: int,
        ttl_seconds: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0 (got {max_entries})")
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0 (got {ttl_seconds})")
        self.max_entries = max_entries
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        self._on_evict = on_evict or (lambda reason: None)
        self._entries: OrderedDict[str, _Entry[_V]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        """False with max_entries 0: nothing is ever stored."""
        return self.max_entries > 0

    def put(self, key: str, value: _V) -> None:
        if not self.enabled:
            return
        self._expire()
        self._entries[key] = _Entry(value, self._clock())
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self._on_evict(EVICT_SIZE)

    def get(self, key: str) -> _V | None:
        """The value, or None when it was never stored, was deleted, evicted or expired."""
        self._expire()
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)  # recently used: evicted last
        return entry.value

    def delete(self, key: str) -> bool:
        self._expire()
        return self._entries.pop(key, None) is not None

    def _expire(self) -> None:
        # Entries are in storing order only until a read moves one to the end, so scan all
        # (the store is bounded; a scan of a few thousand entries costs microseconds).
        horizon = self._clock() - self.ttl_seconds
        old = [k for k, e in self._entries.items() if e.stored_at <= horizon]
        for key in old:
            del self._entries[key]
            self._on_evict(EVICT_TTL)
