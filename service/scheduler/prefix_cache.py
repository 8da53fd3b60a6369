"""Prefix cache: full KV blocks keyed by a chained digest of their tokens, evicted LRU.

A block's key digests (parent block's key, the block's tokens, the content hashes of the images
whose placeholder tokens overlap the block), so a hit on block i implies the whole prefix up to
it matches, images included: two prompts with the same placeholder tokens but different images
never share K/V. blake2b rather than `hash()`: Python's int/tuple hash is easy to
collide on purpose, and a collision would serve one request's K/V to another.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from hashlib import blake2b

ROOT = b""


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """Where an image's placeholder tokens sit in a prompt, and the image's content hash."""

    offset: int
    length: int
    content_hash: bytes


def block_digest(parent: bytes, tokens: list[int], images: bytes = b"") -> bytes:
    """Key of a full block whose tokens follow the prefix keyed `parent`; `images`: the content
    hashes of the images overlapping the block (image_keys)."""
    h = blake2b(parent, digest_size=16)
    h.update(array("I", tokens).tobytes())
    if images:
        h.update(images)
    return h.digest()


def image_keys(images: tuple[ImageSpan, ...], start: int, end: int) -> bytes:
    """Hashes of the images whose placeholders overlap token positions [start, end)."""
    return b"".join(i.content_hash for i in images
                    if i.offset < end and start < i.offset + i.length)


class PrefixCache:
    """Maps block digests to block ids. Blocks no request uses (refcount 0) stay here,
    evictable, in least-recently-freed order; the block manager owns refcounts and free lists."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        # Cached blocks with refcount 0, oldest use first.
        self._evictable: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._block_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def get(self, key: bytes) -> int | None:
        return self._block_of.get(key)

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def insert(self, key: bytes, block: int) -> bool:
        """Registers a newly filled block; False when the key (or block) is already cached."""
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def mark_unused(self, block: int) -> None:
        """The last user of a cached block let it go: it becomes evictable (most recent)."""
        self._evictable[block] = None

    def mark_used(self, block: int) -> None:
        """A cached block with refcount 0 was hit again: no longer evictable."""
        self._evictable.pop(block, None)

    def evict_one(self) -> int | None:
        """Forgets the least recently used evictable block and returns its id (now free)."""
        if not self._evictable:
            return None
        block, _ = self._evictable.popitem(last=False)
        key = self._key_of.pop(block)
        del self._block_of[key]
        return block

    def clear(self) -> list[int]:
        """Forgets everything; returns the evictable blocks (now free)."""
        freed = list(self._evictable)
        self._evictable.clear()
        self._block_of.clear()
        self._key_of.clear()
        return freed
