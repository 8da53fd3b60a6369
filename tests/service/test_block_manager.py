from __future__ import annotations

import pytest

from service.scheduler import BlockManager


def test_allocate_release_refcounts() -> None:
    bm = BlockManager(4, 2)
    a = bm.allocate(3)
    assert a == [0, 1, 2] and bm.num_free == 1
    assert bm.allocate(2) is None  # all or nothing
    assert bm.num_free == 1
    bm.release(a)
    assert bm.num_free == 4
    bm.check_invariants()


def test_double_release_is_an_error() -> None:
    bm = BlockManager(2, 2)
    a = bm.allocate(1)
    bm.release(a)
    with pytest.raises(AssertionError):
        bm.release(a)


def test_blocks_needed() -> None:
    bm = BlockManager(8, 4)
    assert bm.blocks_needed(0, 0) == 0
    assert bm.blocks_needed(1, 0) == 1
    assert bm.blocks_needed(4, 1) == 0
    assert bm.blocks_needed(5, 1) == 1
    assert bm.blocks_needed(9, 0) == 3


def test_shared_block_freed_when_last_user_releases() -> None:
    bm = BlockManager(4, 2)
    tokens = [1, 2, 3, 4, 5]
    blocks = bm.allocate(3)
    keys: list[bytes] = []
    bm.register_full_blocks(tokens, blocks, keys, computed=5)
    assert len(keys) == 2  # two full blocks
    hit, _ = bm.match_prefix(tokens)
    assert hit == blocks[:2]
    assert bm.refcount(blocks[0]) == 2
    bm.release(blocks)
    assert bm.refcount(blocks[0]) == 1 and bm.num_free == 2  # block 2 free, 0,1 still used
    bm.release(hit)
    assert bm.num_free == 4
    bm.check_invariants()


def test_lazy_decode_fast_path() -> None:
    bm = BlockManager(1, 2)
    assert bm.allocate_one() == 0
    assert bm.allocate_one() is None
