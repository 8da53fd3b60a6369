"""The scheduler one plan ahead (the engine's --overlap): plans made before the previous output
is applied, an empty plan in between, requests that finish in the plan in flight."""

from __future__ import annotations

from service.scheduler import StepOutput
from tests.service._sched_helpers import fake_output, make_scheduler, make_seq


def test_an_empty_plan_leaves_later_outputs_aligned_with_their_plans() -> None:
    """An empty plan is never run: the next output must still register the right requests'
    full blocks (a later identical prompt then hits the prefix cache)."""
    sched = make_scheduler(num_blocks=64, block_size=4)
    assert sched.schedule().empty  # nothing to run
    prompt = list(range(10, 27))  # 17 tokens: 4 full blocks
    seq = make_seq(1, prompt)
    seq.max_new_tokens = 1
    sched.add(seq)
    plan = sched.schedule()
    sched.apply_output(plan, fake_output(sched, plan, finish_after={1: 1}))
    sched.add(make_seq(2, prompt))
    sched.schedule()
    assert sched.counters.prefix_cache_hit_tokens == 16


def test_plan_ahead_skips_requests_that_finish_in_the_plan_in_flight() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4)
    seq = make_seq(1, list(range(10, 17)))
    seq.max_new_tokens = 2
    sched.add(seq)
    p1 = sched.schedule()  # prefill: samples token 1
    p2 = sched.schedule()  # ahead: decode of token 1 samples token 2 (the last)
    assert p2.decode_ids == [1] and not p2.finishing
    p3 = sched.schedule()  # ahead of p2: the request finishes in p2, nothing to compute
    assert p3.empty and p3.finishing == [1]
    sched.apply_output(p1, fake_output(sched, p1))
    out2 = fake_output(sched, p2, finish_after={1: 2})
    done = sched.apply_output(p2, out2)
    assert [s.seq_id for s in done] == [1] and not sched.has_work()
    assert sched.blocks.num_free == sched.blocks.num_blocks
    assert isinstance(out2, StepOutput)
