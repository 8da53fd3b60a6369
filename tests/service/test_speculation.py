"""Speculative decoding on the router side: the n-gram proposer, the per-sequence back-off, and
the scheduler's draft blocks (granted before the step, released after it), with hand-made shard
outputs."""

from __future__ import annotations

from service.engine.contracts import FinishReason, TokenInfo
from service.scheduler import (
    BlockManager,
    FinishInfo,
    GenerationOut,
    NgramIndex,
    Scheduler,
    SchedulerConfig,
    SpeculationConfig,
    StepOutput,
)
from service.scheduler.speculation import SpecState
from tests.service._sched_helpers import make_seq


def test_proposer_takes_the_latest_longest_match() -> None:
    idx = NgramIndex(max_n=3, min_n=1)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # "1 2 3" occurred at 0..2 (followed by 9) and 5..7 (followed by 7 8 5): the latest wins.
    assert idx.propose(tokens, 3) == [7, 8, 5]
    assert idx.propose(tokens, 0) == []
    # Incremental: the index grows with the list.
    tokens += [7, 8]
    assert idx.propose(tokens, 2) == [5, 1]  # "3 7 8" -> 5 1


def test_proposer_falls_back_to_shorter_ngrams_and_gives_up() -> None:
    idx = NgramIndex(max_n=3, min_n=2)
    assert idx.propose([4, 5, 6, 1, 5, 6], 2) == [1, 5]  # only the bigram "5 6" matches
    assert NgramIndex(3, 2).propose([1, 2, 3, 4], 4) == []  # nothing repeats
    assert NgramIndex(3, 1).propose([1, 2, 3, 1], 2) == [2, 3]  # unigram "1"


def _latest_match(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """The proposer's rule by brute force: the longest n-gram ending the list whose latest
    earlier occurrence has a continuation, continued periodically."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        for i in range(length - 1, n - 1, -1):
            if tokens[i - n : i] == tokens[length - n :]:
                return [tokens[i + j % (length - i)] for j in range(k)]
    return []


def test_proposer_matches_brute_force_and_leaves_the_collector_alone() -> None:
    import gc
    import random

    rng = random.Random(1)
    for trial in range(100):
        idx, tokens = NgramIndex(), []
        # Few distinct ids (many matches), or ids near 2**32 (the packed keys' widest case).
        for _ in range(50):
            tokens.append(rng.randrange(6) if trial % 2 else rng.randrange(2**32 - 8, 2**32))
            assert idx.propose(tokens, 4) == _latest_match(tokens, 4)
    idx = NgramIndex()
    idx.propose([rng.randrange(128_000) for _ in range(500)], 4)
    # Indexing a long prompt creates nothing the garbage collector tracks.
    assert not any(gc.is_tracked(d) for d in idx._starts.values())


def test_proposer_extends_a_periodic_match() -> None:
    # The text loops with period 3: the continuation runs into the end and keeps cycling.
    tokens = [8, 1, 2, 3, 1, 2, 3, 1, 2]
    assert NgramIndex().propose(tokens, 7) == [3, 1, 2, 3, 1, 2, 3]
    assert NgramIndex().propose([5, 5, 5], 4) == [5, 5, 5, 5]


def test_low_acceptance_backs_off_then_retries() -> None:
    cfg = SpeculationConfig(num_tokens=4, min_acceptance=0.3, cooldown_steps=2, ema_weight=0.5)
    state = SpecState(NgramIndex())
    tokens = [1, 2, 1, 2, 1]
    assert state.propose(tokens, 4)
    state.record(4, 0, cfg)  # 1.0 -> 0.5
    assert state.cooldown == 0
    state.record(4, 0, cfg)  # 0.5 -> 0.25 < 0.3: back off
    assert state.cooldown == 2
    assert state.propose(tokens, 4) == [] and state.propose(tokens, 4) == []
    assert state.propose(tokens, 4) == [2, 1, 2, 1]  # tries again
    assert (state.proposed, state.accepted) == (8, 0)


def _scheduler(num_blocks: int = 32, speculate: int = 4, max_batch: int = 16) -> Scheduler:
    cfg = SchedulerConfig(
        max_batch_prefill_tokens=64,
        max_batch_size=16,
        waiting_served_ratio=0.0,
        speculation=SpeculationConfig(num_tokens=speculate, max_batch_size=max_batch),
    )
    return Scheduler(cfg, BlockManager(num_blocks, 4))


def _gen(seq_id: int, ids: list[int], finish: bool = False) -> GenerationOut:
    toks = [TokenInfo(i, "x", 0.0) for i in ids]
    fin = FinishInfo(FinishReason.LENGTH, "", 0, None) if finish else None
    return GenerationOut(seq_id, toks[0], finish=fin, more=tuple((t, ()) for t in toks[1:]))


def test_drafts_get_blocks_before_the_step_and_give_rejected_ones_back() -> None:
    s = _scheduler()
    s.add(make_seq(1, [1, 2, 3, 4, 1, 2, 3]))  # 7 tokens: blocks 0, 1
    plan = s.schedule()
    assert plan.drafts == []  # prefilling: no drafts
    s.apply_output(plan, StepOutput([_gen(1, [4])], 1))  # tokens 1 2 3 4 1 2 3 4
    seq = s.seqs[1]
    assert seq.computed == 7 and len(seq.blocks) == 2
    plan = s.schedule()
    # "2 3 4" occurred at 1..3, followed by 1 2 3 4 (then it cycles): 4 drafts, positions 8..11
    # of the step need a third block.
    assert plan.drafts == [(1, [1, 2, 3, 4])]
    assert plan.decode_ids == [1] and plan.grants == [(1, [2])]
    # The shard accepted 1 draft and sampled one more token (2 tokens): positions 7, 8 computed.
    s.apply_output(plan, StepOutput([_gen(1, [1, 9])], 1))
    assert seq.token_ids[-2:] == [1, 9] and seq.computed == 9
    assert len(seq.blocks) == 3  # position 8 lives in block 2: kept
    assert s.counters.spec_proposed_tokens == 4 and s.counters.spec_accepted_tokens == 1
    assert s.counters.spec_step_tokens[2] == 1
    s.blocks.check_invariants()
    # "4 1 9" / "1 9" / "9" never occurred: no drafts, a plain one-token step.
    plan = s.schedule()
    assert plan.drafts == [] and plan.decode_ids == [1] and plan.grants == []
    s.apply_output(plan, StepOutput([_gen(1, [5])], 1))
    assert seq.computed == 10 and len(seq.blocks) == 3
    assert s.blocks.num_free == 32 - 3
    s.blocks.check_invariants()


def test_only_blocks_of_accepted_tokens_reach_the_prefix_cache() -> None:
    s = _scheduler()
    s.add(make_seq(1, [5, 6, 7, 5, 6, 7, 5]))
    plan = s.schedule()
    s.apply_output(plan, StepOutput([_gen(1, [6])], 1))  # 8 tokens, 7 computed
    plan = s.schedule()
    assert plan.drafts == [(1, [7, 5, 6, 7])]  # positions 8..11: block 2
    # Every draft rejected: block 2 held only rejected K/V and must not be cached.
    s.apply_output(plan, StepOutput([_gen(1, [1])], 1))
    seq = s.seqs[1]
    assert seq.computed == 8 and len(seq.blocks) == 2
    assert len(s.blocks.cache) == 2  # blocks 0 and 1 (8 computed tokens), nothing else
    assert len(seq.block_hashes) == 2
    s.blocks.check_invariants()


def test_drafts_stop_at_max_new_tokens_and_in_large_steps() -> None:
    s = _scheduler()
    seq = make_seq(1, [3, 4, 3, 4, 3])
    seq.max_new_tokens = 3
    s.add(seq)
    plan = s.schedule()
    s.apply_output(plan, StepOutput([_gen(1, [4])], 1))  # 1 generated, 2 left
    plan = s.schedule()
    assert plan.drafts == [(1, [3])]  # the step may emit 2 tokens: 1 draft at most
    s.apply_output(plan, StepOutput([_gen(1, [3, 4], finish=True)], 1))
    assert s.seqs == {} and s.blocks.num_free == 32
    # More running requests than speculate max_batch_size: no drafts at all.
    s = _scheduler(max_batch=1)
    for i in (1, 2):
        s.add(make_seq(i, [3, 4, 3, 4, 3]))
    plan = s.schedule()
    s.apply_output(plan, StepOutput([_gen(1, [4]), _gen(2, [4])], 1))
    plan = s.schedule()
    assert plan.decode_ids == [1, 2] and plan.drafts == []


def test_drafts_never_take_blocks_that_others_need() -> None:
    # 4 blocks of 4: two requests of 7 tokens hold 2 blocks each; no block is free for drafts,
    # and drafts never preempt.
    s = _scheduler(num_blocks=4)
    for i in (1, 2):
        s.add(make_seq(i, [i, 9, i, 9, i, 9, i]))
    plan = s.schedule()
    s.apply_output(plan, StepOutput([_gen(1, [9]), _gen(2, [9])], 1))
    plan = s.schedule()
    # Position 7 still fits block 1: each may draft only what its own blocks hold (none).
    assert plan.drafts == [] and plan.preempted == []
    s.apply_output(plan, StepOutput([_gen(1, [1]), _gen(2, [2])], 1))
    s.blocks.check_invariants()


def test_speculate_flags_reach_engine_warmup_and_launcher(monkeypatch) -> None:
    import argparse
    from pathlib import Path

    from service.app import launcher
    from service.app.cli import build_parser
    from service.app.router_flags import (
        add_arguments,
        engine_config,
        resolve_limits,
        warmup_budgets,
    )

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--speculate", "4", "--speculate-max-batch-size", "8"])
    limits = resolve_limits(args, 4096)
    cfg = engine_config(args, limits)
    assert (cfg.speculate, cfg.speculate_max_batch_size) == (4, 8)
    sched = cfg.scheduler_config().speculation
    assert (sched.num_tokens, sched.max_batch_size) == (4, 8)
    budgets = warmup_budgets(args, limits)
    assert (budgets.speculate_tokens, budgets.speculate_max_batch_size) == (4, 8)
    off = engine_config(parser.parse_args([]), limits)
    assert off.speculate == 0 and not off.scheduler_config().speculation.enabled
    monkeypatch.setenv("SPECULATE", "3")
    argv = ["launch"]
    router = " ".join(launcher.router_command(build_parser(argv).parse_args(argv), "m",
                                              Path("/m"), "/p"))
    assert "--speculate 3" in router
