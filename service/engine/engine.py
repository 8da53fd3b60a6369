"""The generation engine: one asyncio task runs scheduler steps on the shards and streams events.

    engine = LocalEngine(EngineConfig(num_blocks=..., block_size=..., ...), shard_backend,
                         on_unhealthy=lambda reason: health.set(NOT_SERVING))
    await engine.start()
    stream = engine.submit(validated_request)   # OverloadedError / DrainingError / ShardUnavailable
    async for event in stream: ...               # StepEvents; raises EngineError on failure
    await engine.drain(timeout_s); await engine.stop()

Admission is immediate (submit never awaits). Cancellations and deadlines are applied at step
boundaries: the request is removed from the scheduler (its blocks freed) and the shard is told
(`ShardBackend.filter`) before the next step. Any failed or timed-out shard RPC (ShardRpcError)
fails every in-flight request with ShardUnavailableError, marks the engine unhealthy and stops the
loop: never a hang. The shards are a typed `ShardBackend` (service.engine.backend): no protobuf.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Protocol

from service.engine.adapters import (
    AdapterInfo,
    AdapterLoadError,
    AdapterRegistry,
    AdapterSource,
)
from service.engine.backend import ShardBackend, ShardDescription, ShardRpcError, WarmupInfo
from service.engine.contracts import (
    DeadlineExceededError,
    DrainingError,
    EngineError,
    EngineStats,
    ExpertLoadHistogram,
    Finished,
    OverloadedError,
    ShardUnavailableError,
    StepEvent,
    ValidatedRequest,
)
from service.engine.event_stream import EventStream
from service.scheduler import (
    BlockManager,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SpeculationConfig,
    StepPlan,
)
from service.scheduler.contracts import FinishReason, StepOutput, TokenInfo
from service.scheduler.prefix_cache import ImageSpan
from shard.runtime.gc_pacing import GcPacer

log = logging.getLogger("tokenwire.engine")


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits. `num_blocks` and `block_size` come from the shard's Warmup answer."""

    num_blocks: int = 0  # 0: take it from the warmup answer (build_engine)
    block_size: int = 0
    max_concurrent_requests: int = 128  # queued + running; beyond: OverloadedError
    max_batch_prefill_tokens: int = 4096  # prefill chunk tokens per step
    max_batch_total_tokens: int | None = None  # KV capacity cap, applied by the shard's Warmup
    max_batch_size: int = 256  # requests per step
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20
    enable_prefix_cache: bool = True
    max_loras: int = 0  # the shards' LoRA device slots (their Info; build_engine sets it)
    max_lora_rank: int = 0
    speculate: int = 0  # --speculate: n-gram draft tokens per sequence and step (0: off)
    speculate_max_batch_size: int = 16  # --speculate-max-batch-size: no drafts in larger steps
    # --overlap (the router's default): schedule and send step N+1 before reading step N's
    # answer, so the shard launches it while step N computes (outputs are the same; see
    # service/scheduler). Off here: an engine built directly steps one at a time unless asked.
    overlap: bool = False

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_batch_prefill_tokens=self.max_batch_prefill_tokens,
            max_batch_size=self.max_batch_size,
            waiting_served_ratio=self.waiting_served_ratio,
            max_waiting_tokens=self.max_waiting_tokens,
            max_adapters=self.max_loras,
            speculation=SpeculationConfig(
                num_tokens=self.speculate, max_batch_size=self.speculate_max_batch_size
            ),
        )


_END = object()
# The "error" of a request its reader stopped (a stop sequence matched in the front end): it is
# removed like a cancelled one, then finished with the engine's accounting (RequestStream.stop).
STOPPED = EngineError("stopped by the reader")
# The token of that last event: a placeholder the reader drops.
STOP_PLACEHOLDER = TokenInfo(-1, "", float("nan"))
# Stale entries the deadline heap may hold beyond twice the requests in flight (see _submit).
DEADLINE_HEAP_SLACK = 64


def _tokens_per_step(multi: list[tuple[int, int]] | None, total: int) -> tuple[int, ...]:
    """Tokens of each step of a request that generated `total` tokens, from its multi-token
    steps (tokens before the step, tokens it gave); () when the engine does not speculate."""
    if multi is None:
        return ()
    if not multi:
        return (1,) * total
    out: list[int] = []
    at = 0
    for before, n in multi:
        out.extend([1] * (before - at))
        out.append(n)
        at = before + n
    out.extend([1] * (total - at))
    return tuple(out)


class _Stream(EventStream):
    """RequestStream of one request in this process."""

    __slots__ = ("_engine", "admitted_at", "request", "scheduled_at", "seq_id", "step_tokens")

    def __init__(self, engine: LocalEngine, seq_id: int, request: ValidatedRequest) -> None:
        super().__init__(engine._loop)  # the engine's (submit runs on it): no lookup per wait
        self._engine = engine
        self.seq_id = seq_id
        self.request = request
        self.admitted_at = time.monotonic()
        self.scheduled_at: float | None = None
        # The steps that gave it several tokens, as (tokens generated before the step, tokens
        # the step gave), recorded when the engine speculates; every other step gave one token.
        # Finished.tokens_per_step is rebuilt from these at the end (_tokens_per_step), so a
        # step that drafts nothing records nothing.
        self.step_tokens: list[tuple[int, int]] | None = [] if engine.config.speculate else None

    def push(self, event: StepEvent) -> None:
        self._events.append(event)
        if event.finished is not None:
            self._closed = True
        if self._waiter is not None:
            self._wake()

    def _cancelled(self) -> None:
        self._engine._cancel(self.seq_id)

    def _stopped(self) -> None:
        self._engine._cancel(self.seq_id, STOPPED)


class EventSink(Protocol):
    """Receives the events of many requests (an out-of-process front end, service/app/scheduler_process.py):
    `add` for each event during a step, `flush` once at the end of every step that added any
    (one batched message per front end per step instead of one wakeup per request), `fail` for
    a request's failure (at any time)."""

    rows: list[object]

    def add(self, key: int, event: StepEvent) -> None: ...

    def flush(self) -> None: ...

    def fail(self, key: int, error: EngineError) -> None: ...


class _SinkStream(_Stream):
    """A request whose events go to an EventSink instead of a reader."""

    __slots__ = ("key", "sink")

    def __init__(
        self, engine: LocalEngine, seq_id: int, request: ValidatedRequest, sink: EventSink,
        key: int,
    ) -> None:  # fmt: skip
        super().__init__(engine, seq_id, request)
        self.sink = sink
        self.key = key

    def push(self, event: StepEvent) -> None:
        sink = self.sink
        if not sink.rows:
            self._engine._dirty_sinks.append(sink)
        sink.add(self.key, event)
        if event.finished is not None:
            self._closed = True

    def fail(self, error: EngineError) -> None:
        if self._closed:
            return
        self._closed = True
        self.sink.fail(self.key, error)


class LocalEngine:
    """The engine in this process: service.engine.contracts.Engine over a scheduler and a
    ShardBackend (the multi-process router's front ends use service.app.remote_engine.RemoteEngine,
    the same interface over a unix socket to the process running this one)."""

    def __init__(
        self,
        config: EngineConfig,
        shard: ShardBackend,
        on_unhealthy: Callable[[str], None] | None = None,
    ) -> None:
        if config.num_blocks <= 0 or config.block_size <= 0:
            raise ValueError("EngineConfig needs num_blocks and block_size (see build_engine)")
        self.config = config
        self.shard = shard
        self.on_unhealthy = on_unhealthy
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_cache)
        self.scheduler = Scheduler(config.scheduler_config(), self.blocks)
        self.adapters = AdapterRegistry(config.max_loras, config.max_lora_rank)
        self._adapters_loading: set[str] = set()
        self.healthy = True
        self.unhealthy_reason: str | None = None
        self.draining = False
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count(1)
        self._arrivals = itertools.count()
        self._cancelled: list[tuple[int, EngineError | None]] = []
        self._dirty_sinks: list[EventSink] = []
        # Awaited before each step when set: lets out-of-process front ends pace the engine
        # (service/app/scheduler_process.py), so that an instant shard cannot run far ahead of the streams.
        self.step_gate: Callable[[], Awaitable[None]] | None = None
        # Full garbage collections between bursts of work (the process owner installs it).
        self.gc_pacer: GcPacer | None = None
        # (deadline, seq_id) min-heap. A request that ends before its deadline leaves its entry
        # behind (lazy deletion); _submit compacts the heap once stale entries outnumber live
        # ones, so it holds at most 2 x in-flight + DEADLINE_HEAP_SLACK entries instead of one
        # per request admitted in the last deadline's worth of time (hours for long deadlines);
        # when the last request leaves, every entry is stale and the heap is emptied.
        self._deadlines: list[tuple[float, int]] = []
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        # Overlap: the step sent and not yet applied (its plan, its call, CPU-time marks).
        self._inflight: tuple[StepPlan, asyncio.Task[StepOutput]] | None = None
        if config.overlap:
            shard.overlap = True
        self._idle = asyncio.Event()
        self._idle.set()
        self._capacity_tokens = config.num_blocks * config.block_size
        # Stats.
        self._last_batch_size = 0
        self.sched_cpu_s = 0.0  # schedule() + apply_output()
        self.step_cpu_s = 0.0  # all router-side work of a step (scheduling, protos, events)
        self.max_sched_cpu_s = 0.0
        # MoE models: the shards' routing windows (tokenwire_moe_expert_load_ratio)
        self.expert_load = ExpertLoadHistogram()
        self._shard_cpu_s = 0.0  # the backend's cpu_seconds counted so far

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        """Stops the loop; remaining requests fail with DrainingError."""
        self.draining = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task  # _run never raises anything else (it marks unhealthy)
            self._task = None
        self._drop_inflight()
        self._fail_all(DrainingError("the server is shutting down"))

    async def close(self) -> None:
        await self.stop()

    async def drain(self, timeout_s: float) -> bool:
        """Stops admission and waits up to `timeout_s` for in-flight requests; True when all
        finished, else the rest fail with DrainingError."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            self._fail_all(DrainingError("the server is shutting down"), notify_shard=True)
            return False

    # --- Engine API ---------------------------------------------------------------------------
    def submit(self, request: ValidatedRequest) -> _Stream:
        return self._submit(request, None, 0)

    def submit_to(self, request: ValidatedRequest, sink: EventSink, key: int) -> _Stream:
        """Like submit, but the request's events go to `sink` under `key` (batched per step);
        `cancel()` on the returned stream still removes it."""
        return self._submit(request, sink, key)

    def _submit(self, request: ValidatedRequest, sink: EventSink | None, key: int) -> _Stream:
        if not self.healthy:
            raise ShardUnavailableError(f"shard unavailable: {self.unhealthy_reason}")
        if self.draining:
            raise DrainingError("the server is shutting down")
        if len(self._streams) >= self.config.max_concurrent_requests:
            raise OverloadedError(
                f"too many requests in flight (max_concurrent_requests="
                f"{self.config.max_concurrent_requests})"
            )
        need = len(request.input_ids) + request.stopping.max_new_tokens
        if need > self._capacity_tokens:
            raise OverloadedError(
                f"input + max_new_tokens = {need} exceeds the KV cache capacity "
                f"{self._capacity_tokens} tokens"
            )
        salt = self.adapters.cache_salt(request.adapter) if request.adapter else b""
        seq_id = next(self._ids)
        stream = (
            _Stream(self, seq_id, request)
            if sink is None
            else _SinkStream(self, seq_id, request, sink, key)
        )
        self.scheduler.add(
            Sequence(
                seq_id=seq_id,
                token_ids=list(request.input_ids),
                prompt_len=len(request.input_ids),
                arrival=next(self._arrivals),
                prefill_logprobs=request.prefill_logprobs,
                payload=request,
                adapter=request.adapter,
                cache_salt=salt,
                images=tuple(ImageSpan(i.offset, i.length, i.content_hash)
                             for i in request.images),
                max_new_tokens=request.stopping.max_new_tokens,
                speculate=request.grammar is None,
            )
        )
        self._streams[seq_id] = stream
        self._idle.clear()
        if request.deadline is not None:
            deadlines = self._deadlines
            if len(deadlines) >= 2 * len(self._streams) + DEADLINE_HEAP_SLACK:
                deadlines[:] = [d for d in deadlines if d[1] in self._streams]
                heapq.heapify(deadlines)
            heapq.heappush(deadlines, (request.deadline, seq_id))
        self._wake.set()
        return stream

    def stats(self) -> EngineStats:
        c = self.scheduler.counters
        steps = max(c.steps, 1)
        return EngineStats(
            queued=self.scheduler.num_waiting,
            running=self.scheduler.num_running,
            kv_blocks_total=self.blocks.num_blocks,
            kv_blocks_free=self.blocks.num_free,
            block_size=self.config.block_size,
            last_batch_size=self._last_batch_size,
            steps=c.steps,
            prefill_tokens_computed=c.prefill_tokens_computed,
            prefix_cache_hit_tokens=c.prefix_cache_hit_tokens,
            preemptions=c.preemptions,
            aborted=c.aborted,
            extra={
                "scheduler_cpu_seconds_total": self.sched_cpu_s,
                "scheduler_cpu_seconds_per_step": self.sched_cpu_s / steps,
                "step_cpu_seconds_total": self.step_cpu_s,
                "step_cpu_seconds_per_step": self.step_cpu_s / steps,
                "scheduler_cpu_seconds_max_step": self.max_sched_cpu_s,
                "healthy": 1.0 if self.healthy else 0.0,
                # Sizes of the engine's bookkeeping, for memory soaks (benchmarks/soak.py):
                # per-request structures return to 0 when idle; the prefix cache is bounded
                # by the KV blocks (README, "Memory").
                "requests_tracked": float(len(self._streams)),
                "deadline_entries": float(len(self._deadlines)),
                "prefix_cache_blocks": float(len(self.blocks.cache)),
            },
            spec_proposed_tokens=c.spec_proposed_tokens,
            spec_accepted_tokens=c.spec_accepted_tokens,
            spec_step_tokens=tuple(c.spec_step_tokens),
            expert_load=(ExpertLoadHistogram(list(self.expert_load.counts), self.expert_load.total,
                                             self.expert_load.windows)
                         if self.expert_load.windows else None),
        )

    # --- LoRA adapters --------------------------------------------------------------------------
    def list_adapters(self) -> list[AdapterInfo]:
        return self.adapters.list()

    async def load_adapters(self, sources: list[AdapterSource]) -> list[AdapterInfo]:
        """Loads every adapter on every shard, or none of them (those this call loaded are
        unloaded again when a later one fails); usable by requests once this returns."""
        if not self.healthy:
            raise ShardUnavailableError(f"shard unavailable: {self.unhealthy_reason}")
        names = [s.name for s in sources]
        if not sources:
            raise AdapterLoadError("adapters: give at least one {name, path}")
        if len(set(names)) != len(names):
            raise AdapterLoadError(f"adapters: a name appears twice: {names}")
        for source in sources:
            if source.name in self._adapters_loading:
                raise AdapterLoadError(f"adapter '{source.name}' is being loaded by another call")
            self.adapters.check_new(source)
        self._adapters_loading.update(names)
        loaded: list[AdapterInfo] = []
        try:
            for source in sources:
                try:
                    loaded.append(await self.shard.load_adapter(source))
                except ShardRpcError as error:
                    if error.status in ("INVALID_ARGUMENT", "FAILED_PRECONDITION"):
                        raise AdapterLoadError(error.details or str(error)) from None
                    raise ShardUnavailableError(f"loading adapter '{source.name}': {error}"
                                                ) from None
        except BaseException:
            for info in loaded:
                with contextlib.suppress(ShardRpcError):
                    await self.shard.unload_adapter(info.name)
            raise
        finally:
            self._adapters_loading.difference_update(names)
        for info in loaded:
            self.adapters.add(info)
            log.info("adapter %s loaded from %s (rank %d)", info.name, info.path, info.rank)
        return loaded

    async def unload_adapter(self, name: str, poll_s: float = 0.02) -> None:
        """Unloads an adapter: new requests for it fail with AdapterNotFoundError at once; the
        ones already admitted finish first (this waits for them), then the shards drop it."""
        self.adapters.begin_unload(name)
        try:
            while any(st.request.adapter == name for st in self._streams.values()):
                await asyncio.sleep(poll_s)
            while True:
                try:
                    await self.shard.unload_adapter(name)
                    break
                except ShardRpcError as error:
                    # A request removed at the last step boundary is forgotten by the shard at
                    # the next one (FilterBatch): retry until then.
                    if error.status != "FAILED_PRECONDITION":
                        raise ShardUnavailableError(f"unloading adapter '{name}': {error}"
                                                    ) from None
                    self._wake.set()
                    await asyncio.sleep(poll_s)
        except BaseException:
            self.adapters.cancel_unload(name)
            raise
        self.adapters.remove(name)
        log.info("adapter %s unloaded", name)

    def _cancel(self, seq_id: int, error: EngineError | None = None) -> None:
        self._cancelled.append((seq_id, error))
        self._wake.set()

    # --- loop -----------------------------------------------------------------------------------
    async def _run(self) -> None:
        sched = self.scheduler
        try:
            while True:
                if self.step_gate is not None:
                    await self.step_gate()
                self._apply_cancellations()
                if self._inflight is not None and (
                    not self.config.overlap
                    or sched.wants_drafts()
                    or not sched.has_work()
                    or not sched.can_plan_ahead()
                ):  # read the step sent last before planning (drafts need its tokens; its
                    # finished requests' blocks may spare a preemption)
                    await self._complete_inflight()
                    await asyncio.sleep(0)
                    continue
                if not sched.has_work():
                    self._wake.clear()
                    if self._cancelled:
                        continue
                    if self.gc_pacer is not None:
                        self.gc_pacer.idle()
                    await self._wake.wait()
                    continue
                if not await self._step():
                    # Nothing could run (cannot happen with the submit checks; never spin).
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), 0.05)
                    except TimeoutError:
                        pass
                    continue
                if self.gc_pacer is not None:
                    self.gc_pacer.step()
                # Let submitters, readers and cancellations run between steps.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure (RPC, timeout, protocol) ends the loop
            self._drop_inflight()
            self._mark_unhealthy(e)

    def _drop_inflight(self) -> None:
        if self._inflight is not None:
            self._inflight[1].cancel()
            self._inflight = None

    async def _complete_inflight(self) -> None:
        plan, task = self._inflight  # type: ignore[misc]
        self._inflight = None
        out = await task
        self._apply(plan, out)

    def _apply_cancellations(self) -> None:
        now = time.monotonic()
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, seq_id = heapq.heappop(deadlines)
            if seq_id in self._streams:
                self._cancelled.append(
                    (
                        seq_id,
                        DeadlineExceededError("the request deadline passed before it finished"),
                    )
                )
        if not self._cancelled:
            return
        cancelled, self._cancelled = self._cancelled, []
        for seq_id, error in cancelled:
            stream = self._streams.pop(seq_id, None)
            if stream is None:
                continue
            if error is STOPPED:
                self._finish_stopped(stream, self.scheduler.abort(seq_id, finished=True))
                continue
            self.scheduler.abort(seq_id)
            if error is not None:
                stream.fail(error)
        if self._dirty_sinks:
            self._flush_sinks()
        if not self._streams:
            self._went_idle()

    def _went_idle(self) -> None:
        """No request is in flight: every deadline entry is stale, so the heap is emptied now
        rather than at the next compaction (an idle router holds nothing per request)."""
        self._deadlines.clear()
        self._idle.set()

    def _finish_stopped(self, stream: _Stream, seq: Sequence | None) -> None:
        """The last event of a request its reader stopped: the engine's accounting of the
        tokens generated so far (the reader cuts it at the stop sequence's token)."""
        total = seq.generated_len if seq is not None else 0
        now = time.monotonic()
        scheduled_at = stream.scheduled_at or now
        sampling = stream.request.sampling
        stream.push(StepEvent(STOP_PLACEHOLDER, finished=Finished(
            generated_text="",
            generated_tokens=total,
            finish_reason=FinishReason.STOP_SEQUENCE,
            seed=sampling.seed if sampling.do_sample else None,
            queue_seconds=scheduled_at - stream.admitted_at,
            inference_seconds=now - scheduled_at,
            prefix_cache_hit_tokens=seq.prefix_hit_tokens if seq is not None else 0,
            tokens_per_step=_tokens_per_step(stream.step_tokens, total),
        )))  # fmt: skip

    def _flush_sinks(self) -> None:
        dirty, self._dirty_sinks = self._dirty_sinks, []
        for sink in dirty:
            sink.flush()

    async def _step(self) -> bool:
        """Runs one step; False when the plan was empty."""
        t0 = time.thread_time()
        sched = self.scheduler
        plan = sched.schedule()
        t_sched = time.thread_time() - t0

        if plan.removed_from_shard:
            if self._inflight is not None:
                # The filter must reach the shard after the step sent last: read that first.
                await self._complete_inflight()
            await self.shard.filter(plan.keep_ids)
        if plan.empty:
            if self._inflight is not None:  # nothing new until its answer: read it
                await self._complete_inflight()
                return True
            self._fail_unfittable(plan)
            return bool(plan.removed_from_shard or plan.preempted)
        now = time.monotonic()
        streams = self._streams
        for c in plan.chunks:
            st = streams.get(c.seq_id)
            if st is not None and st.scheduled_at is None:
                st.scheduled_at = now
        self.sched_cpu_s += t_sched
        self.max_sched_cpu_s = max(self.max_sched_cpu_s, t_sched)
        self.step_cpu_s += time.thread_time() - t0
        self._last_batch_size = plan.batch_size
        if not self.config.overlap:
            self._apply(plan, await self.shard.step(plan))
            return True
        # Overlap: send this step (its call builds and sends the request at once), then read
        # and apply the one before it while the shard computes.
        task = asyncio.get_running_loop().create_task(self.shard.step(plan))
        prev, self._inflight = self._inflight, (plan, task)
        await asyncio.sleep(0)  # let the call go out before anything changes the plan's lists
        if prev is not None:
            self._apply(prev[0], await prev[1])
        return True

    def _apply(self, plan: StepPlan, out: StepOutput) -> None:
        """Applies a step's answer: scheduler state, then the requests' events."""
        t1 = time.thread_time()
        sched = self.scheduler
        finished = sched.apply_output(plan, out)
        t_sched = time.thread_time() - t1
        streams = self._streams
        if out.expert_load is not None:
            self.expert_load.observe(out.expert_load)

        # Events.
        hits = {s.seq_id: s.prefix_hit_tokens for s in finished if s.prefix_hit_tokens}
        now = time.monotonic()
        for gen in out.generations:
            stream = streams.get(gen.seq_id)
            if stream is None:
                continue  # cancelled during the step
            fin = gen.finish
            if gen.more:  # several tokens from this step (speculative decoding): one event each
                if stream.step_tokens is not None:
                    # Tokens generated so far, this step's included (the scheduler appended them).
                    total = fin.generated_tokens if fin is not None else (
                        sched.seqs[gen.seq_id].generated_len)
                    stream.step_tokens.append((total - gen.num_tokens, gen.num_tokens))
                stream.push(StepEvent(gen.token, gen.top_tokens, gen.prefill))
                last = len(gen.more) - 1
                for j, (token, top) in enumerate(gen.more):
                    if j < last or fin is None:
                        stream.push(StepEvent(token, top))
                if fin is None:
                    continue
                final = StepEvent(*gen.more[-1])
            else:
                final = StepEvent(gen.token, gen.top_tokens, gen.prefill)
                if fin is None:
                    stream.push(final)
                    continue
            del streams[gen.seq_id]
            scheduled_at = stream.scheduled_at or now
            finished_ev = Finished(
                generated_text=fin.text,
                generated_tokens=fin.generated_tokens,
                finish_reason=fin.reason,
                seed=stream.request.sampling.seed if stream.request.sampling.do_sample else None,
                queue_seconds=scheduled_at - stream.admitted_at,
                inference_seconds=now - scheduled_at,
                prefix_cache_hit_tokens=hits.get(gen.seq_id, 0),
                tokens_per_step=_tokens_per_step(stream.step_tokens, fin.generated_tokens),
            )
            stream.push(replace(final, finished=finished_ev))
        if self._dirty_sinks:
            self._flush_sinks()
        if not streams:
            self._went_idle()
        self.sched_cpu_s += t_sched
        self.max_sched_cpu_s = max(self.max_sched_cpu_s, t_sched)
        shard_cpu_s = self.shard.cpu_seconds  # building and reading the RPCs
        self.step_cpu_s += time.thread_time() - t1 + shard_cpu_s - self._shard_cpu_s
        self._shard_cpu_s = shard_cpu_s

    def _fail_unfittable(self, plan: StepPlan) -> None:
        """A lone request preempted itself: it can never fit the KV cache."""
        sched = self.scheduler
        if sched.num_running == 0 and plan.preempted:
            for seq_id in plan.preempted:
                self._cancelled.append(
                    (seq_id, OverloadedError("the request does not fit the KV cache"))
                )

    def _mark_unhealthy(self, error: BaseException) -> None:
        if isinstance(error, ShardRpcError):
            reason = str(error)  # "shard RPC failed: STATUS: details"
        else:
            reason = f"{type(error).__name__}: {error}"
        log.error("engine unhealthy: %s", reason)
        self.healthy = False
        self.unhealthy_reason = reason
        self._fail_all(ShardUnavailableError(f"shard unavailable: {reason}"))
        if self.on_unhealthy is not None:
            try:
                self.on_unhealthy(reason)
            except Exception:
                log.exception("on_unhealthy callback failed")

    def _fail_all(self, error: EngineError, notify_shard: bool = False) -> None:
        if notify_shard:
            # Remove them through the normal path at the next boundary (blocks freed, filtered).
            for seq_id, stream in list(self._streams.items()):
                stream.fail(error)
                self._cancel(seq_id)
            return
        streams, self._streams = self._streams, {}
        # Pending cancellations and deadlines name only these requests; the loop may have
        # stopped (unhealthy) and would never drain them.
        self._cancelled = []
        self._deadlines = []
        self.scheduler.abort_all()
        for stream in streams.values():
            stream.fail(error)
        self._idle.set()


def build_engine(
    *,
    client: ShardBackend,
    warmup: WarmupInfo,
    config: EngineConfig,
    shard: ShardDescription | None = None,
    on_unhealthy: Callable[[str], None] | None = None,
) -> LocalEngine:
    """The engine for a warmed-up shard: KV geometry from `warmup` unless set in `config`.
    Call `await engine.start()` before submitting."""
    config = replace(
        config,
        num_blocks=config.num_blocks or warmup.num_blocks,
        block_size=config.block_size or warmup.block_size,
    )
    if shard is not None:  # LoRA slots and the adapters the shards loaded at start-up
        config = replace(config, max_loras=shard.max_loras, max_lora_rank=shard.max_lora_rank)
    engine = LocalEngine(config, client, on_unhealthy=on_unhealthy)
    if shard is not None:
        engine.adapters.base_model_id = shard.model_id
        for info in shard.adapters:
            engine.adapters.add(info)
    return engine
