from __future__ import annotations

from service.scheduler import RequestState
from tests.service._sched_helpers import fake_output, make_scheduler, make_seq, step


def test_prefill_then_decode_one_token_per_step() -> None:
    s = make_scheduler(block_size=4)
    s.add(make_seq(1, list(range(6))))
    plan, _ = step(s)
    assert [(c.cache_len, c.chunk_len) for c in plan.chunks] == [(0, 6)]
    assert plan.chunks[0].blocks == [0, 1]  # 6 tokens: 2 blocks, granted lazily
    assert plan.decode_ids == []
    seq = s.seqs[1]
    assert seq.computed == 6 and seq.token_ids[-1] == 1000
    plan, _ = step(s)  # position 6 fits block 1
    assert plan.chunks == [] and plan.decode_ids == [1] and plan.grants == []
    plan, _ = step(s)  # position 7 fits block 1
    assert plan.grants == []
    plan, _ = step(s)  # position 8 needs a third block
    assert plan.grants == [(1, [2])]
    assert seq.computed == 9 and len(seq.token_ids) == 10


def test_chunked_prefill_under_budget_fused_with_decode() -> None:
    s = make_scheduler(block_size=4, budget=8)
    s.add(make_seq(1, [1, 2, 3]))
    step(s)  # 1 is decoding now
    s.add(make_seq(2, list(range(20))))
    plan, _ = step(s)
    assert plan.decode_ids == [1]
    assert [(c.seq_id, c.cache_len, c.chunk_len) for c in plan.chunks] == [(2, 0, 8)]
    assert len(plan.chunks[0].blocks) == 2
    plan, _ = step(s)
    assert [(c.cache_len, c.chunk_len) for c in plan.chunks] == [(8, 8)]
    assert plan.decode_ids == [1]
    plan, _ = step(s)
    assert [(c.cache_len, c.chunk_len) for c in plan.chunks] == [(16, 4)]
    assert s.seqs[2].prefill_done
    plan, _ = step(s)
    assert plan.chunks == [] and plan.decode_ids == [1, 2]


def test_budget_shared_by_several_new_requests_fifo() -> None:
    s = make_scheduler(budget=10)
    for i in range(3):
        s.add(make_seq(i, [i] * 6))  # distinct prompts: no prefix-cache hits
    plan, _ = step(s)
    assert [(c.seq_id, c.chunk_len) for c in plan.chunks] == [(0, 6), (1, 4)]
    plan, _ = step(s)
    # running first: 0 decodes, 1 finishes its prefill, then 2 starts with what is left.
    assert plan.decode_ids == [0]
    assert [(c.seq_id, c.cache_len, c.chunk_len) for c in plan.chunks] == [(1, 4, 2), (2, 0, 6)]


def test_max_batch_size_limits_admission() -> None:
    s = make_scheduler(max_batch_size=2)
    for i in range(3):
        s.add(make_seq(i, [1, 2]))
    plan, _ = step(s)
    assert len(plan.chunks) == 2 and s.num_waiting == 1
    plan, fin = step(s, finish_after={0: 2})
    assert [f.seq_id for f in fin] == [0]
    plan, _ = step(s)
    assert [c.seq_id for c in plan.chunks] == [2]


def test_waiting_served_ratio_and_max_waiting_tokens() -> None:
    s = make_scheduler(ratio=1.0, max_waiting=3)
    s.add(make_seq(0, [1, 2]))
    s.add(make_seq(1, [1, 2]))
    step(s)  # both admitted: nothing was decoding
    s.add(make_seq(2, [1, 2]))
    # 1 waiting < 1.0 * 2 decoding: keep decoding for max_waiting_tokens steps.
    for _ in range(3):
        plan, _ = step(s)
        assert plan.chunks == []
    plan, _ = step(s)
    assert [c.seq_id for c in plan.chunks] == [2]


def test_preempts_youngest_and_recomputes_prompt_plus_generated() -> None:
    # 4 blocks of 2 tokens; two requests of 3 prompt tokens take 2 blocks each.
    s = make_scheduler(num_blocks=4, block_size=2, budget=64)
    s.add(make_seq(1, [10, 11, 12]))
    s.add(make_seq(2, [20, 21, 22]))
    step(s)
    assert s.blocks.num_free == 0
    step(s)  # positions 3: both fit in their second block
    # position 4 needs a block for each: 1 (oldest) preempts 2 (youngest).
    plan, _ = step(s)
    assert plan.preempted == [2] and plan.removed_from_shard == [2]
    assert plan.keep_ids == [1]
    assert plan.decode_ids == [1] and plan.grants and plan.grants[0][0] == 1
    victim = s.seqs[2]
    assert victim.state is RequestState.WAITING and victim.blocks == [] and victim.computed == 0
    assert victim.token_ids == [20, 21, 22, 1000, 1001]  # generated tokens kept
    assert s.waiting[0] is victim
    assert s.counters.preemptions == 1
    # Finish 1; 2 is recomputed with input prompt + generated and generated_len 2.
    plan, fin = step(s, finish_after={1: 4})
    assert [f.seq_id for f in fin] == [1]
    plan = s.schedule()
    [chunk] = plan.chunks
    assert chunk.seq_id == 2 and chunk.input_ids == [20, 21, 22, 1000, 1001]
    assert chunk.generated_len == 2 and chunk.cache_len + chunk.chunk_len == 5
    assert chunk.cache_len == 2  # its first full block came back from the prefix cache
    s.apply_output(plan, fake_output(s, plan))
    assert s.seqs[2].token_ids[-1] == 1002  # continues where it stopped


def test_preempted_request_goes_back_in_arrival_order() -> None:
    s = make_scheduler(num_blocks=6, block_size=2)
    for i in range(3):
        s.add(make_seq(i, [i, i, i]))
    step(s)
    step(s)
    plan, _ = step(s)  # every one needs a third block: only youngest is preempted
    assert plan.preempted == [2]
    assert [q.seq_id for q in s.running] == [0, 1]


def test_a_request_that_is_youngest_preempts_itself() -> None:
    s = make_scheduler(num_blocks=2, block_size=2)
    s.add(make_seq(1, [1, 2, 3]))
    step(s)
    step(s)
    plan, _ = step(s)  # needs a 3rd block, none exist
    assert plan.preempted == [1] and plan.decode_ids == [] and plan.chunks == []
    assert s.num_running == 0 and s.num_waiting == 1


def test_mid_prefill_request_in_cached_batch_without_budget_keeps_running() -> None:
    s = make_scheduler(budget=4, block_size=4)
    s.add(make_seq(1, list(range(10))))
    s.add(make_seq(2, list(range(10))))
    plan, _ = step(s)
    assert [(c.seq_id, c.chunk_len) for c in plan.chunks] == [(1, 4)]
    plan, _ = step(s)
    assert [(c.seq_id, c.cache_len, c.chunk_len) for c in plan.chunks] == [(1, 4, 4)]


def test_abort_frees_blocks_and_filters_on_next_step() -> None:
    s = make_scheduler(num_blocks=8, block_size=4)
    s.add(make_seq(1, list(range(6))))
    s.add(make_seq(2, list(range(100, 106))))
    step(s)
    used = s.blocks.num_used
    s.abort(2)
    assert s.blocks.num_used == used - 2
    plan, _ = step(s)
    assert plan.removed_from_shard == [2] and plan.keep_ids == [1]
    assert s.abort(2) is None  # idempotent
    s.abort(1)
    s.blocks.check_invariants()
    assert s.blocks.num_free == 8


def test_abort_waiting_request() -> None:
    s = make_scheduler(max_batch_size=1)
    s.add(make_seq(1, [1]))
    s.add(make_seq(2, [1]))
    step(s)
    s.abort(2)
    assert s.num_waiting == 0
    plan, _ = step(s)
    assert plan.removed_from_shard == []


def test_no_block_leak_after_many_requests_with_preemption() -> None:
    import random

    rng = random.Random(0)
    s = make_scheduler(num_blocks=12, block_size=4, budget=16, max_batch_size=8)
    lengths: dict[int, int] = {}
    done: set[int] = set()
    aborted = [0]
    next_id = 0
    for _ in range(600):
        if next_id < 200 and rng.random() < 0.5:
            prompt = [rng.randrange(5) for _ in range(rng.randrange(1, 20))]
            s.add(make_seq(next_id, prompt))
            lengths[next_id] = rng.randrange(1, 12)
            next_id += 1
        if rng.random() < 0.02 and s.running:
            s.abort(rng.choice(s.running).seq_id)
            aborted[0] += 1
        _, fin = step(s, finish_after=lengths)
        for f in fin:
            assert f.generated_len == lengths[f.seq_id]
            done.add(f.seq_id)
    for _ in range(10_000):
        if not s.has_work():
            break
        _, fin = step(s, finish_after=lengths)
        done.update(f.seq_id for f in fin)
    assert s.counters.preemptions > 0
    s.blocks.check_invariants()
    assert s.blocks.num_free == 12  # everything free or evictable
    assert all(s.blocks.refcount(b) == 0 for b in range(12))
    assert len(done) == 200 - aborted[0]


def test_prefill_one_token_short_runs_even_without_budget() -> None:
    s = make_scheduler(budget=8, block_size=4)
    s.add(make_seq(2, [2] * 9))
    step(s)  # 8 of 9 computed
    # An older request (e.g. a preempted one back in arrival order) takes the whole budget.
    older = make_seq(1, [1] * 30)
    older.arrival = -1
    s.add(older)
    s.waiting.remove(older)
    older.state = RequestState.RUNNING
    s.running.insert(0, older)
    plan = s.schedule()
    assert [(c.seq_id, c.cache_len, c.chunk_len) for c in plan.chunks] == [(1, 0, 8), (2, 8, 1)]
