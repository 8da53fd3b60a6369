"""Thin gRPC servicer of tokenwire.shard.v1: decode the proto, run the domain call on the single
model worker thread, encode the reply. Domain errors become status codes in `_STATUS` only."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from tokenwire.shard.v1 import shard_pb2 as pb
from tokenwire.shard.v1 import shard_pb2_grpc

from shard.errors import (
    FailedPreconditionError,
    FatalDeviceError,
    InvalidRequestError,
    NotFoundError,
    ShardError,
)
from shard.runtime import GcPacer
from shard.server import convert
from shard.server.loader import Shard
from shard.server.step_profile import StepProfiler
from shard.server.tracing import StepTracer

log = logging.getLogger(__name__)
# A router between two steps sends the next one within milliseconds; this long without a step
# means it is idle.
_IDLE_GC_DELAY_S = 0.1

# domain error class -> gRPC status code (the one mapping)
_STATUS: dict[type[ShardError], grpc.StatusCode] = {
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    NotFoundError: grpc.StatusCode.NOT_FOUND,
    FailedPreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    FatalDeviceError: grpc.StatusCode.INTERNAL,
}


def _status_class(exc: ShardError) -> type[ShardError]:
    """The _STATUS key of exc: its class or the nearest listed base (AdapterLoadError is an
    InvalidRequestError)."""
    return next(c for c in type(exc).__mro__ if c in _STATUS)  # type: ignore[return-value]


class ShardServicer(shard_pb2_grpc.ShardServiceServicer):
    def __init__(
        self,
        shard: Shard,
        urls: list[str],
        on_fatal: Callable[[str], None],
        tracer: StepTracer | None = None,
        profiler: StepProfiler | None = None,
        gc_pacer: GcPacer | None = None,
    ):
        self.shard = shard
        self.tracer = tracer  # step spans of traced requests (None: tracing off)
        self.profiler = profiler  # device timeline of a window of steps (None: off)
        # Full garbage collections when no step is in flight (None: CPython's own schedule).
        self.gc_pacer = gc_pacer
        self._steps_in_flight = 0
        self._last_step_end = 0.0  # time.monotonic() when the last step RPC ended
        self._idle_after = -1.0  # _last_step_end when the pacer's idle() last ran
        self.urls = urls
        self.on_fatal = on_fatal
        # One worker: model steps run in RPC order, never concurrently, off the event loop.
        self.worker = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="shard-model", initializer=shard.bind_thread
        )
        self.fatal: str | None = None
        # Overlapped steps (step_index > 0) launch in index order: the highest launched so far.
        self._launched = 0
        self._turn = asyncio.Condition()

    async def _run(self, context: grpc.aio.ServicerContext, fn: Callable[..., Any], *args) -> Any:
        if self.fatal is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"shard failed: {self.fatal}")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.worker, fn, *args)
        except ShardError as exc:
            code, message = _STATUS[_status_class(exc)], str(exc)
            if isinstance(exc, FatalDeviceError):
                self.fatal = message
                self.on_fatal(message)
        except Exception as exc:  # a bug, not the caller's fault
            log.exception("internal error")
            code, message = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
        await context.abort(code, message)

    async def Info(self, request, context):
        return convert.info_to_proto(self.shard.info, self.shard.adapters())

    async def ServiceDiscovery(self, request, context):
        return pb.ServiceDiscoveryResponse(urls=self.urls)

    async def Health(self, request, context):
        if self.fatal is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"shard failed: {self.fatal}")
        try:  # its own thread: answers while a long step holds the model worker
            await asyncio.to_thread(self.shard.health)
        except Exception as exc:  # noqa: BLE001 - any failure means the device is not usable
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"device check failed: {exc}")
        return pb.HealthResponse()

    async def Warmup(self, request, context):
        result = await self._run(context, self.shard.warmup, convert.warmup_from_proto(request))
        return convert.warmup_to_proto(result)

    async def Prefill(self, request, context):
        with self._step_in_flight():
            return await self._prefill(request, context)

    async def Decode(self, request, context):
        with self._step_in_flight():
            return await self._decode(request, context)

    @contextlib.contextmanager
    def _step_in_flight(self) -> Iterator[None]:
        """Counts the step RPCs being served; once none is left (and none arrived within
        _IDLE_GC_DELAY_S), the GC pacer may run a full collection: it pauses no step."""
        self._steps_in_flight += 1
        try:
            yield
        finally:
            self._steps_in_flight -= 1
            self._last_step_end = time.monotonic()
            if self.gc_pacer is not None:
                self.gc_pacer.step()
                if self._steps_in_flight == 0:
                    asyncio.get_running_loop().call_later(_IDLE_GC_DELAY_S, self._idle_gc)

    def _idle_gc(self) -> None:
        """A full collection if no step RPC is in flight and none ended in the last
        _IDLE_GC_DELAY_S (a later step's own timer checks again)."""
        if self._steps_in_flight or self.gc_pacer is None:
            return
        if self._idle_after == self._last_step_end:  # this quiet period had its collection
            return
        wait = _IDLE_GC_DELAY_S - (time.monotonic() - self._last_step_end)
        if wait > 0.001:  # a step ended meanwhile: its quiet period is not over
            asyncio.get_running_loop().call_later(wait, self._idle_gc)
        else:
            self._idle_after = self._last_step_end
            self.gc_pacer.idle()

    async def _prefill(self, request, context):
        start = time.time_ns()
        args = convert.prefill_from_proto(request)
        engine = self.shard.engine
        if request.step_index:
            result = await self._overlapped(
                context, request.step_index, self._counted(engine.launch_prefill, "prefill"),
                *args,
            )
        else:
            result = await self._run(context, self._counted(engine.prefill, "prefill"), *args)
        reply = convert.prefill_to_proto(result, request.packed_generations)
        if self.tracer is not None:
            self.tracer.prefill(request, reply, start, time.time_ns())
        return reply

    async def _decode(self, request, context):
        start = time.time_ns()
        args = convert.decode_from_proto(request)
        engine = self.shard.engine
        if request.step_index:
            result = await self._overlapped(
                context, request.step_index, self._counted(engine.launch_decode, "decode"), *args
            )
        else:
            result = await self._run(context, self._counted(engine.decode, "decode"), *args)
        reply = convert.decode_to_proto(result, request.packed_generations)
        if self.tracer is not None:
            self.tracer.decode(request, reply, start, time.time_ns())
        return reply

    def _counted(self, step_fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        """step_fn, telling the profiler (if any) on the worker when a step's RPC arrived
        (now) and when its launch began and ended."""
        profiler = self.profiler
        if profiler is None:
            return step_fn
        arrived = time.perf_counter()

        def launch(*args: Any) -> Any:
            profiler.before_launch(kind)
            start = time.perf_counter()
            result = step_fn(*args)
            profiler.launched(arrived, start, time.perf_counter())
            return result

        return launch

    async def _overlapped(
        self, context: grpc.aio.ServicerContext, index: int, launch: Callable[..., Any], *args
    ) -> Any:
        """An overlapped step: launched on the model worker after step index - 1 (so the next
        step can be launched while this one computes), waited for off the worker, then
        finished on the worker (detokenization, stopping, Generations): by its own `finish`
        call or by the next step's launch, whichever comes first."""
        async with self._turn:
            await self._turn.wait_for(lambda: self._launched >= index - 1)
        try:
            step = await self._run(context, launch, *args, True)
        finally:
            async with self._turn:
                self._launched = max(self._launched, index)
                self._turn.notify_all()
        # The result is set on the worker by whichever call finishes the step first: the
        # `finish` below, or the next step's launch settling it (an eager step does not overlap
        # on CUDA; see BatchState.overlap_eager_steps). Waiting for either hands it over as soon
        # as it exists, not after the next launch is done with the worker.
        loop = asyncio.get_running_loop()
        ready = loop.create_future()

        def signal() -> None:
            loop.call_soon_threadsafe(lambda: ready.done() or ready.set_result(None))

        step.on_result = signal
        if step.result is not None:
            return step.result
        await asyncio.to_thread(step.wait_device)
        if step.result is None:
            finisher = asyncio.ensure_future(self._run(context, self.shard.engine.finish, step))
            # Left running when `ready` wins (it then returns the set result); never unread.
            finisher.add_done_callback(lambda t: t.cancelled() or t.exception())
            await asyncio.wait({ready, finisher}, return_when=asyncio.FIRST_COMPLETED)
            if not ready.done() or step.result is None:
                return await finisher  # it ran first (or failed: its abort raises here)
        return step.result

    async def FilterBatch(self, request, context):
        ref = await self._run(
            context, self.shard.engine.filter_batch, request.batch_id, list(request.request_ids)
        )
        if self.tracer is not None:
            self.tracer.filter(list(request.request_ids))
        return pb.FilterBatchResponse(batch=convert.cached_batch_to_proto(ref))

    async def ClearCache(self, request, context):
        batch_id = request.id if request.HasField("id") else None
        await self._run(context, self.shard.engine.clear_cache, batch_id)
        if batch_id is None:  # a new router: its overlapped steps count from 1
            async with self._turn:
                self._launched = 0
                self._turn.notify_all()
        if self.tracer is not None:
            self.tracer.clear()
        return pb.ClearCacheResponse()

    async def LoadAdapter(self, request, context):
        source = convert.adapter_source_from_proto(request)
        try:  # file I/O and validation off the model worker: steps go on meanwhile
            adapter = await asyncio.to_thread(self.shard.read_adapter, source)
        except ShardError as exc:
            await context.abort(_STATUS[_status_class(exc)], str(exc))
        except Exception as exc:
            log.exception("reading adapter %s failed", source.name)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"adapter '{source.name}': {type(exc).__name__}: {exc}")
        facts = await self._run(context, self.shard.register_adapter, adapter)
        return pb.LoadAdapterResponse(adapter=convert.adapter_to_proto(facts))

    async def UnloadAdapter(self, request, context):
        await self._run(context, self.shard.unload_adapter, request.name)
        return pb.UnloadAdapterResponse()

    async def close_profiler(self) -> None:
        """Writes the profile (if any) on the model worker: the profiler started there, and
        stops on the thread that started it."""
        if self.profiler is not None:
            await asyncio.get_running_loop().run_in_executor(self.worker, self.profiler.close)

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)
