"""Paged KV block manager owned by the router: lazy grants, refcounts, prefix cache.

Blocks are ints 0 .. num_blocks-1. A block is either free, used (refcount > 0) or cached and
unused (refcount 0, evictable through the prefix cache). Allocation takes free blocks first, then
evicts cached ones LRU. `release` is the only way blocks go back.
"""

from __future__ import annotations

from service.scheduler.prefix_cache import ROOT, ImageSpan, PrefixCache, block_digest, image_keys


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._refcount = [0] * num_blocks
        # Pop from the end: low block ids first (nicer to read in tests and logs).
        self._free = list(range(num_blocks - 1, -1, -1))
        self.cache = PrefixCache()

    # --- capacity -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be granted now: free plus evictable cached ones."""
        return len(self._free) + self.cache.num_evictable

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, num_tokens: int, have: int) -> int:
        """Blocks to add to a table of `have` blocks so it covers `num_tokens` tokens."""
        need = -(-num_tokens // self.block_size) - have
        return max(0, need)

    # --- grants and release -----------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """Grants n blocks (refcount 1), evicting unused cached blocks LRU; None if impossible."""
        if n > len(self._free) + self.cache.num_evictable:
            return None
        out: list[int] = []
        free = self._free
        refcount = self._refcount
        for _ in range(n):
            block = free.pop() if free else self.cache.evict_one()
            assert block is not None and refcount[block] == 0, block
            refcount[block] = 1
            out.append(block)
        return out

    def allocate_one(self) -> int | None:
        """Fast path of allocate(1) (decode growth)."""
        if self._free:
            block = self._free.pop()
        else:
            block = self.cache.evict_one()
            if block is None:
                return None
        self._refcount[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        """Drops one reference to each block; unused blocks become free or evictable."""
        refcount = self._refcount
        cache = self.cache
        # Reverse order: a sequence's tail blocks become evictable before its head, so LRU
        # eviction trims prefixes from the end and keeps the shared heads longest.
        for block in reversed(blocks):
            rc = refcount[block] - 1
            if rc < 0:
                raise AssertionError(f"block {block} released twice")
            refcount[block] = rc
            if rc == 0:
                if cache.is_cached(block):
                    cache.mark_unused(block)
                else:
                    self._free.append(block)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    # --- prefix cache -----------------------------------------------------------------------
    def match_prefix(
        self, token_ids: list[int], root: bytes = ROOT, images: tuple[ImageSpan, ...] = ()
    ) -> tuple[list[int], list[bytes]]:
        """Takes a reference on the longest run of cached full blocks that prefix `token_ids`,
        leaving at least one token to compute (the step that samples needs a computed token).
        `root`: the chain's start (a LoRA adapter's salt: its K/V differ from the base's)."""
        if not self.enable_prefix_cache:
            return [], []
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        blocks: list[int] = []
        keys: list[bytes] = []
        parent = root
        cache = self.cache
        refcount = self._refcount
        for i in range(max_blocks):
            extra = image_keys(images, i * bs, (i + 1) * bs) if images else b""
            key = block_digest(parent, token_ids[i * bs : (i + 1) * bs], extra)
            block = cache.get(key)
            if block is None:
                break
            if refcount[block] == 0:
                cache.mark_used(block)
            refcount[block] += 1
            blocks.append(block)
            keys.append(key)
            parent = key
        return blocks, keys

    def register_full_blocks(
        self, token_ids: list[int], blocks: list[int], keys: list[bytes], computed: int,
        root: bytes = ROOT, images: tuple[ImageSpan, ...] = (),
    ) -> None:
        """Records the keys of blocks that became full (all tokens computed) in the cache.
        `keys` holds the keys of the leading full blocks already known; it is extended."""
        bs = self.block_size
        full = computed // bs
        if len(keys) >= full:
            return
        parent = keys[-1] if keys else root
        cache = self.cache
        for i in range(len(keys), full):
            extra = image_keys(images, i * bs, (i + 1) * bs) if images else b""
            key = block_digest(parent, token_ids[i * bs : (i + 1) * bs], extra)
            keys.append(key)
            if self.enable_prefix_cache:
                cache.insert(key, blocks[i])
            parent = key

    def clear_cache(self) -> None:
        """Drops every unused cached block back to the free list."""
        self._free.extend(self.cache.clear())

    def check_invariants(self) -> None:
        """Test helper: every block is exactly one of free / used / evictable."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate free block"
        evictable = set(self.cache._evictable)
        for b in range(self.num_blocks):
            states = (b in free) + (b in evictable) + (self._refcount[b] > 0)
            assert states == 1, (
                f"block {b}: free={b in free} evictable={b in evictable} rc={self._refcount[b]}"
            )
