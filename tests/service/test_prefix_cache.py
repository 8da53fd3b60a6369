from __future__ import annotations

from service.scheduler import BlockManager, block_digest
from service.scheduler.prefix_cache import ROOT
from tests.service._sched_helpers import make_scheduler, make_seq, step


def _fill(bm: BlockManager, tokens: list[int]) -> list[int]:
    blocks = bm.allocate(bm.blocks_needed(len(tokens), 0))
    bm.register_full_blocks(tokens, blocks, [], computed=len(tokens))
    return blocks


def test_digest_chains_over_the_prefix() -> None:
    a = block_digest(ROOT, [1, 2])
    assert block_digest(a, [3, 4]) != block_digest(block_digest(ROOT, [9, 9]), [3, 4])
    assert block_digest(ROOT, [1, 2]) == a


def test_hit_leaves_at_least_one_token_to_compute() -> None:
    bm = BlockManager(8, 2)
    blocks = _fill(bm, [1, 2, 3, 4])
    bm.release(blocks)
    hit, _ = bm.match_prefix([1, 2, 3, 4])
    assert hit == blocks[:1]  # the full 2nd block would leave nothing to compute
    hit2, _ = bm.match_prefix([1, 2, 3, 4, 5])
    assert hit2 == blocks


def test_only_exact_prefix_hits() -> None:
    bm = BlockManager(8, 2)
    _fill(bm, [1, 2, 3, 4, 5])
    assert bm.match_prefix([9, 2, 3, 4, 5])[0] == []
    assert len(bm.match_prefix([1, 2, 3, 9, 5])[0]) == 1


def test_unused_cached_blocks_count_as_free_and_are_evicted_lru() -> None:
    bm = BlockManager(4, 2)
    a = _fill(bm, [1, 1, 1, 1])  # blocks 0,1
    b = _fill(bm, [2, 2, 2, 2])  # blocks 2,3
    bm.release(a)
    bm.release(b)
    assert bm.num_free == 4 and len(bm.cache) == 4
    # Touch a: it becomes most recently used.
    hit, _ = bm.match_prefix([1, 1, 1, 1, 0])
    bm.release(hit)
    new = bm.allocate(2)  # evicts b's blocks first (least recently used)
    assert sorted(new) == sorted(b)
    assert bm.match_prefix([2, 2, 2, 2, 0])[0] == []
    hit, _ = bm.match_prefix([1, 1, 1, 1, 0])
    assert hit == a
    bm.check_invariants()


def test_scheduler_second_request_reuses_prefix() -> None:
    s = make_scheduler(num_blocks=32, block_size=4, budget=64)
    prefix = list(range(16))
    s.add(make_seq(1, prefix + [100, 101]))
    step(s, finish_after={1: 3})
    computed_first = s.counters.prefill_tokens_computed
    assert computed_first == 18
    s.add(make_seq(2, prefix + [200]))
    plan = s.schedule()
    [chunk] = plan.chunks
    assert chunk.cache_len == 16 and chunk.chunk_len == 1
    assert chunk.blocks[:4] == s.seqs[1].blocks[:4]  # shared physical blocks
    assert s.seqs[2].prefix_hit_tokens == 16
    assert s.counters.prefix_cache_hit_tokens == 16


def test_prefill_logprobs_request_skips_the_cache() -> None:
    s = make_scheduler(block_size=4)
    s.add(make_seq(1, list(range(9))))
    step(s)
    s.add(make_seq(2, list(range(9)), prefill_logprobs=True))
    plan = s.schedule()
    [chunk] = plan.chunks
    assert chunk.cache_len == 0 and chunk.chunk_len == 9 and chunk.prefill_logprobs


def test_finished_request_blocks_stay_cached_until_evicted() -> None:
    s = make_scheduler(num_blocks=4, block_size=4)
    s.add(make_seq(1, list(range(9))))
    step(s, finish_after={1: 1})
    assert s.blocks.num_free == 4  # 2 cached + evictable, 1 free
    assert len(s.blocks.cache) == 2
    s.add(make_seq(2, [7] * 15))  # needs all 4 blocks: evicts the cached ones
    plan, _ = step(s)
    assert plan.chunks[0].cache_len == 0 and len(plan.chunks[0].blocks) == 4
    assert len(s.blocks.cache) == 0 or all(s.blocks.refcount(b) > 0 for b in plan.chunks[0].blocks)
