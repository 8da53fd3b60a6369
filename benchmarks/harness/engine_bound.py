"""The engine-only bound of a workload: the router's scheduler and the shard's batch state and
model runner driven in ONE process, with no gRPC, no streaming and no per-request events.

    bound = run_engine_bound(shard, workload, EngineBoundConfig(...), overlap=True)

`InProcessShard` plays the part of service.shard_client + shard.server (StepPlan in, StepOutput
out, domain types only); `drive` is the engine's step loop without streams: schedule, step,
apply_output, until every request finished. With `overlap`, the loop schedules and launches step
N+1 before it reads step N's output (the scheduler one plan ahead, the shard's
launch/finish split), exactly as the served path does with `--overlap`.

Reported: wall time, req/s and output tok/s of the run, and the pure-GPU bound: the sum over
the steps the run executed of their device time (forward + sampling, CUDA events;
shard.engine.step_timer), i.e. the run's wall time if the host cost nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from service.scheduler import BlockManager, Scheduler, SchedulerConfig, Sequence, StepPlan
from service.scheduler.contracts import (
    FinishInfo,
    FinishReason,
    GenerationOut,
    StepOutput,
    TokenInfo,
)
from shard.engine.batches import BatchState, LaunchedStep
from shard.engine.contracts import (
    BatchSpec,
    BlockGrant,
    CachedBatchRef,
    RequestSpec,
    StepResult,
)
from shard.engine.sampling import SamplingParams
from shard.engine.step_timer import GpuStepTimer
from shard.errors import NotFoundError


@dataclass(frozen=True)
class WorkRequest:
    """One request of a workload: its prompt token ids and how it generates."""

    input_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_sequences: tuple[str, ...] = ()
    ignore_eos_token: bool = False
    # The shard makes no text (as for the served router's default --router-detokenize, which
    # then detokenizes in its front ends); this driver matches no stop sequences itself, so
    # give none with it.
    ids_only: bool = False


@dataclass(frozen=True)
class EngineBoundConfig:
    """The router's scheduling limits (as `tokenwire router` flags)."""

    max_batch_prefill_tokens: int = 8192
    max_batch_size: int = 512
    enable_prefix_cache: bool = True


@dataclass
class StepRecord:
    """Host-side timeline of one step of `drive` (perf_counter seconds from the run's start)."""

    batch: int  # rows of the plan
    chunk_tokens: int  # prompt tokens of its prefill chunks (0: a pure decode step)
    launch_start: float
    launch_end: float
    synced: bool  # the step in flight was applied before this step was planned
    apply_start: float = float("nan")  # its output read and applied (after the next launch
    apply_end: float = float("nan")  # when overlapped)


@dataclass
class EngineBoundResult:
    requests: int
    wall_seconds: float
    output_tokens: int
    steps: int
    gpu_ms: float  # sum of the steps' device time
    mean_batch: float
    tokens: dict[int, list[int]]  # request index -> generated ids
    finish: dict[int, str]  # request index -> finish reason
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    overlapped_steps: int = 0  # steps the shard launched before finishing the previous one
    paused_seconds: float = 0.0  # spent in on_step (profiler start/stop), left out of the wall
    step_log: list[StepRecord] = field(default_factory=list)
    step_gpu_ms: list[float] = field(default_factory=list)  # device time of each step (CUDA)
    step_gaps_ms: list[float] = field(default_factory=list)  # device idle between steps (CUDA)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_seconds

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_seconds

    def summary(self) -> dict:
        gpu_s = self.gpu_ms / 1e3
        return {
            "requests": self.requests, "wall_seconds": self.wall_seconds,
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "output_tokens": self.output_tokens, "steps": self.steps,
            "mean_batch": self.mean_batch, "gpu_seconds": gpu_s,
            "gpu_bound_requests_per_s": self.requests / gpu_s if gpu_s else float("nan"),
            "gpu_bound_output_tokens_per_s": self.output_tokens / gpu_s if gpu_s else float("nan"),
            "gpu_busy_fraction": gpu_s / self.wall_seconds,
            "preemptions": self.preemptions, "prefix_hit_tokens": self.prefix_hit_tokens,
            "overlapped_steps": self.overlapped_steps,
            "paused_seconds": self.paused_seconds,
        }


_REASONS = {r.name: r for r in FinishReason}


def step_output(result: StepResult) -> StepOutput:
    """The shard's StepResult as the scheduler consumes it (token ids, texts, finishes)."""
    gens = []
    for g in result.generations:
        t = g.tokens
        out = GenerationOut(g.request_id, TokenInfo(t.ids[0], t.texts[0], t.logprobs[0]))
        if len(t.ids) > 1:
            out.more = tuple(
                (TokenInfo(t.ids[i], t.texts[i], t.logprobs[i]), ()) for i in range(1, len(t.ids))
            )
        if g.finished is not None:
            f = g.finished
            out.finish = FinishInfo(_REASONS[f.finish_reason.name], f.text, f.generated_tokens,
                                    f.seed)
        gens.append(out)
    ref = result.batch
    return StepOutput(gens, ref.id if ref else None, list(ref.request_ids) if ref else [])


class InProcessShard:
    """StepPlans on a BatchState in this process (what the gRPC client and the shard servicer
    do over the wire). Tracks the shard's running batch like service.shard_client does; with
    `overlap`, a step may be launched before the previous one is finished."""

    def __init__(self, engine: BatchState, overlap: bool) -> None:
        self.engine = engine
        self.overlap = overlap
        self._next_batch = 1
        self._batch_id: int | None = None
        self._request_ids: list[int] = []

    def launch(self, plan: StepPlan) -> LaunchedStep:
        grants = [BlockGrant(rid, list(blocks)) for rid, blocks in plan.grants]
        if plan.finishing:  # finish in the step in flight: left out of this one's batch
            gone = set(plan.finishing)
            self._request_ids = [r for r in self._request_ids if r not in gone]
        drafts = {rid: list(tokens) for rid, tokens in plan.drafts} or None
        if plan.chunks:
            specs = []
            for c in plan.chunks:
                w: WorkRequest = c.payload  # type: ignore[assignment]
                specs.append(RequestSpec(
                    id=c.seq_id, input_ids=list(c.input_ids), cache_len=c.cache_len,
                    chunk_len=c.chunk_len, blocks=list(c.blocks), generated_len=c.generated_len,
                    sampling=w.sampling, max_new_tokens=w.max_new_tokens,
                    stop_sequences=list(w.stop_sequences), ignore_eos_token=w.ignore_eos_token,
                    prefill_logprobs=c.prefill_logprobs, ids_only=w.ids_only,
                ))
            batch_id = self._next_batch
            self._next_batch += 1
            cached = (CachedBatchRef(self._batch_id, list(self._request_ids))
                      if self._batch_id is not None else None)
            step = self.engine.launch_prefill(BatchSpec(batch_id, specs), cached, grants, drafts,
                                              overlap=self.overlap)
            known = set(self._request_ids)
            self._request_ids = self._request_ids + [s.id for s in specs if s.id not in known]
            self._batch_id = batch_id
        else:
            assert self._batch_id is not None
            ref = CachedBatchRef(self._batch_id, list(self._request_ids))
            step = self.engine.launch_decode([ref], grants, drafts, overlap=self.overlap)
        return step

    def finish(self, step: LaunchedStep) -> StepOutput:
        out = step_output(self.engine.finish(step))
        if self.overlap:  # the batch as sent, minus what finished (and what filters removed)
            done = {g.seq_id for g in out.generations if g.finish is not None}
            self._request_ids = [r for r in self._request_ids if r not in done]
        else:  # the answer is the shard's batch
            self._batch_id = out.batch_id
            self._request_ids = out.batch_request_ids
        return out

    def filter(self, keep_ids: list[int]) -> None:
        if self._batch_id is None:
            return
        if keep_ids:
            try:
                self._request_ids = self.engine.filter_batch(self._batch_id, keep_ids).request_ids
            except NotFoundError:  # overlap: all of it finished at the step in flight
                if not self.overlap:
                    raise
                self._request_ids = []
        else:
            self.engine.clear_cache(self._batch_id)
            self._batch_id = None
            self._request_ids = []


def drive(
    engine: BatchState,
    workload: list[WorkRequest],
    config: EngineBoundConfig,
    num_blocks: int,
    block_size: int,
    overlap: bool,
    on_step: Callable[[int], None] | None = None,
) -> EngineBoundResult:
    """Runs every request of `workload` (all arriving at once) to completion. on_step(n) is
    called before the n-th step is launched (n = 0, 1, ...; e.g. to start a profiler); the
    time spent in it is left out of the wall time (the device may finish the step in flight
    meanwhile: at most one step's time is credited that way per call that pauses)."""
    sched = Scheduler(
        SchedulerConfig(max_batch_prefill_tokens=config.max_batch_prefill_tokens,
                        max_batch_size=config.max_batch_size),
        BlockManager(num_blocks, block_size, config.enable_prefix_cache),
    )
    shard = InProcessShard(engine, overlap)
    timer = GpuStepTimer(engine.runner.device)
    engine.gpu_timer = timer
    tokens: dict[int, list[int]] = {i: [] for i in range(len(workload))}
    finish: dict[int, str] = {}
    batch_total = 0
    steps = 0

    def apply(plan: StepPlan, step: LaunchedStep) -> None:
        out = shard.finish(step)
        sched.apply_output(plan, out)
        for g in out.generations:
            idx = g.seq_id - 1
            if idx in finish:
                continue
            tokens[idx].append(g.token.id)
            tokens[idx].extend(t.id for t, _ in g.more)
            if g.finish is not None:
                finish[idx] = g.finish.reason.value

    t0 = time.perf_counter()
    for i, w in enumerate(workload):
        sched.add(Sequence(seq_id=i + 1, token_ids=list(w.input_ids), prompt_len=len(w.input_ids),
                           arrival=i, payload=w, max_new_tokens=w.max_new_tokens))
    inflight: tuple[StepPlan, LaunchedStep, StepRecord] | None = None
    overlapped = engine.overlapped_steps
    log: list[StepRecord] = []
    synced = False
    paused = 0.0

    def apply_timed(plan: StepPlan, step: LaunchedStep, rec: StepRecord) -> None:
        rec.apply_start = time.perf_counter() - t0
        apply(plan, step)
        rec.apply_end = time.perf_counter() - t0
    try:
        while sched.has_work() or inflight is not None:
            if inflight is not None and (not overlap or sched.wants_drafts()
                                         or not sched.has_work() or not sched.can_plan_ahead()):
                apply_timed(*inflight)
                inflight = None
                synced = True
                continue
            plan = sched.schedule()
            if plan.removed_from_shard:
                shard.filter(plan.keep_ids)
            if plan.empty:
                if inflight is None:
                    raise RuntimeError("nothing can run: a request does not fit the KV cache")
                apply_timed(*inflight)
                inflight = None
                synced = True
                continue
            if on_step is not None:  # a profiler's start/stop: its pause is not the engine's
                pause_start = time.perf_counter()
                on_step(steps)
                paused += time.perf_counter() - pause_start
            steps += 1
            batch_total += plan.batch_size
            launch_start = time.perf_counter() - t0
            step = shard.launch(plan)
            rec = StepRecord(plan.batch_size, sum(c.chunk_len for c in plan.chunks),
                             launch_start, time.perf_counter() - t0, synced)
            log.append(rec)
            synced = False
            if inflight is not None:
                apply_timed(*inflight)
            inflight = (plan, step, rec)
    finally:
        engine.settle()
        engine.gpu_timer = None
    wall = time.perf_counter() - t0 - paused
    return EngineBoundResult(
        requests=len(workload), wall_seconds=wall,
        output_tokens=sum(len(t) for t in tokens.values()), steps=steps,
        gpu_ms=timer.total_ms(), mean_batch=batch_total / max(steps, 1), tokens=tokens,
        finish=finish, preemptions=sched.counters.preemptions,
        prefix_hit_tokens=sched.counters.prefix_cache_hit_tokens,
        overlapped_steps=engine.overlapped_steps - overlapped, step_log=log,
        paused_seconds=paused,
        step_gpu_ms=timer.step_ms(), step_gaps_ms=timer.gaps_ms(),
    )
