"""Hand-made step outputs for scheduler unit tests."""

from __future__ import annotations

from service.engine.contracts import FinishReason, TokenInfo
from service.scheduler import (
    BlockManager,
    FinishInfo,
    GenerationOut,
    Scheduler,
    SchedulerConfig,
    Sequence,
    StepOutput,
    StepPlan,
)

_arrivals = iter(range(10**9))


def make_seq(seq_id: int, prompt: list[int], prefill_logprobs: bool = False) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        token_ids=list(prompt),
        prompt_len=len(prompt),
        arrival=next(_arrivals),
        prefill_logprobs=prefill_logprobs,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_batch_size: int = 16,
    ratio: float = 0.0,
    max_waiting: int = 20,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_batch_prefill_tokens=budget,
        max_batch_size=max_batch_size,
        waiting_served_ratio=ratio,
        max_waiting_tokens=max_waiting,
    )
    return Scheduler(cfg, BlockManager(num_blocks, block_size))


def fake_output(
    sched: Scheduler, plan: StepPlan, finish_after: dict[int, int] | None = None
) -> StepOutput:
    """A token (id 1000 + generated index) for every decode and every chunk that completes its
    input; finishes a request once it has `finish_after[id]` generated tokens."""
    finish_after = finish_after or {}
    gens = []
    ids = [c.seq_id for c in plan.chunks if c.cache_len + c.chunk_len == len(c.input_ids)]
    for seq_id in ids + plan.decode_ids:
        seq = sched.seqs[seq_id]
        n = seq.generated_len + 1
        finish = None
        if n >= finish_after.get(seq_id, 10**9):
            finish = FinishInfo(FinishReason.LENGTH, "", n, None)
        gens.append(GenerationOut(seq_id, TokenInfo(1000 + n - 1, "x", 0.0), finish=finish))
    return StepOutput(gens, batch_id=1)


def step(sched: Scheduler, finish_after: dict[int, int] | None = None):
    plan = sched.schedule()
    out = fake_output(sched, plan, finish_after)
    finished = sched.apply_output(plan, out)
    sched.blocks.check_invariants()
    return plan, finished
