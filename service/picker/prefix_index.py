"""Which replica has served which prompt prefixes: the picker's approximation of the replicas'
prefix caches (the same idea as GIE's approximate prefix-cache scorer).

A prompt is cut into chunks of `chunk_chars` characters; chunk i is keyed by a hash chained over
chunks 0..i, so a key stands for a whole prefix. Each replica has an LRU of the keys of the
prompts last sent to it, bounded like its KV cache (`capacity` keys). A request matches a replica
by the number of its leading keys found there: that many chunks of its prompt are probably still
cached on that replica. Only full chunks are keyed (a replica caches whole KV blocks only).
"""

from __future__ import annotations

from collections import OrderedDict


def prefix_keys(text: str, chunk_chars: int, max_chunks: int) -> list[int]:
    """Chained hashes of the first `max_chunks` full chunks of `text`."""
    keys: list[int] = []
    key = 0
    full = min(len(text) // chunk_chars, max_chunks)
    for i in range(full):
        key = hash((key, text[i * chunk_chars : (i + 1) * chunk_chars]))
        keys.append(key)
    return keys


class PrefixIndex:
    """Per-replica LRU sets of prefix keys."""

    def __init__(self, default_capacity: int = 1 << 16) -> None:
        self.default_capacity = default_capacity
        self._keys: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    def set_capacity(self, replica: str, keys: int) -> None:
        """Bounds `replica`'s LRU (from its KV cache size); evicts down to it."""
        self._capacity[replica] = max(1, keys)
        self._trim(replica)

    def matched(self, keys: list[int], replica: str) -> int:
        """How many leading `keys` `replica` holds."""
        held = self._keys.get(replica)
        if not held:
            return 0
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def record(self, keys: list[int], replica: str) -> None:
        """`replica` is about to compute (and cache) this prefix."""
        held = self._keys.setdefault(replica, OrderedDict())
        # Tail first: the head ends most recent, so eviction trims prefixes from their ends, as
        # the replica's own cache does.
        for key in reversed(keys):
            held[key] = None
            held.move_to_end(key)
        self._trim(replica)

    def forget(self, replica: str) -> None:
        """`replica` lost its cache (restarted, failed)."""
        self._keys.pop(replica, None)

    def size(self, replica: str) -> int:
        return len(self._keys.get(replica, ()))

    def _trim(self, replica: str) -> None:
        held = self._keys.get(replica)
        if held is None:
            return
        capacity = self._capacity.get(replica, self.default_capacity)
        while len(held) > capacity:
            held.popitem(last=False)
