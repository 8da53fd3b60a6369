"""A front end of the multi-process router (see service.app.scheduler_process): the public
router (`service.app.serve.serve`) over a `RemoteEngine`, the scheduler process's engine reached
through one unix socket (service.app.engine_link), with a client-request limit shared by all
front ends (`SharedAdmission`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.app.engine_link import ACK, frame, read_frame, tune_gc
from service.app.engine_source import ShardConnection
from service.app.serve import serve
from service.engine.adapters import AdapterInfo, AdapterSource
from service.engine.backend import ShardRpcError
from service.engine.contracts import (
    DrainingError,
    EngineError,
    EngineStats,
    ShardUnavailableError,
    StepEvent,
    TokenInfo,
    ValidatedRequest,
)
from service.engine.event_stream import EventStream
from service.observability.logs import setup_logging

_log = logging.getLogger("tokenwire.frontend")


class _RemoteStream(EventStream):
    """RequestStream of a request running in the scheduler process: each event the reader
    takes counts towards acknowledging the scheduler's step frames (pacing)."""

    __slots__ = ("_engine", "key")

    def __init__(self, engine: RemoteEngine, key: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._engine = engine
        self.key = key

    def _taken(self, event: StepEvent) -> StepEvent:
        engine = self._engine
        engine._pending -= 1
        if engine._ack_owed and engine._pending <= engine._ack_below:
            engine._ack()
        if event.finished is not None:
            self._closed = True
        return event

    def cancel(self) -> None:
        if self._events:  # never read now: they no longer hold back the acknowledgement
            self._engine._pending -= len(self._events)
            self._events.clear()
        super().cancel()

    def _cancelled(self) -> None:
        self._engine._cancel(self.key)

    def _stopped(self) -> None:  # a stop sequence matched here: the engine sends the last event
        self._engine._stop(self.key)


class RemoteEngine:
    """service.engine.contracts.Engine over the scheduler process's engine (one unix socket)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        backlog_steps: float,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._streams: dict[int, _RemoteStream] = {}
        self._keys = itertools.count(1)
        self._stats = EngineStats()
        self._idle = asyncio.Event()
        self._idle.set()
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[None] | None = None
        self.healthy = True
        self.unhealthy_reason: str | None = None
        self.draining = False
        self.on_unhealthy: Any = None
        # Called with each adapter name a new set no longer holds (an unload, whichever front
        # end it came through): this front end drops that adapter's metric series.
        self.on_adapter_removed: Callable[[str], None] | None = None
        # The LoRA adapters requests may name: the scheduler process sends the set at hello and
        # after every change, and answers an admin call only once each front end has it.
        self._adapters: list[AdapterInfo] = []
        self._admin_calls: dict[int, asyncio.Future[tuple[Any, BaseException | None]]] = {}
        self._admin_ids = itertools.count(1)
        self._pending = 0  # events received and not yet read by their stream
        self._ack_owed = 0  # step frames to acknowledge once _pending <= _ack_below
        self._ack_below = 0
        # A step frame is acknowledged once the streams here have at most this many steps'
        # worth of events queued (--frontend-backlog-steps).
        self._backlog_steps = backlog_steps

    async def hello(self) -> tuple[Any, Any, Any]:
        self._writer.write(frame(("hello",)))
        msg = await read_frame(self._reader)
        assert msg[0] == "hello", msg
        return msg[1], msg[2], msg[3]

    async def start(self) -> None:
        if self._task is None:
            self._task = self._loop.create_task(self._receive(), name="remote-engine")

    def submit(self, request: ValidatedRequest) -> _RemoteStream:
        if not self.healthy:
            raise ShardUnavailableError(f"shard unavailable: {self.unhealthy_reason}")
        if self.draining:
            raise DrainingError("the server is shutting down")
        key = next(self._keys)
        stream = _RemoteStream(self, key, self._loop)
        self._streams[key] = stream
        self._idle.clear()
        self._writer.write(frame(("sub", key, request)))
        return stream

    def stats(self) -> EngineStats:
        return self._stats

    # LoRA adapters: run by the scheduler process's engine (service.app.scheduler_process).
    def list_adapters(self) -> list[AdapterInfo]:
        return list(self._adapters)

    async def load_adapters(self, sources: list[AdapterSource]) -> list[AdapterInfo]:
        loaded: list[AdapterInfo] = await self._admin("load", sources)
        return loaded

    async def unload_adapter(self, name: str) -> None:
        await self._admin("unload", name)

    async def _admin(self, op: str, arg: object) -> Any:
        if not self.healthy:
            raise ShardUnavailableError(f"shard unavailable: {self.unhealthy_reason}")
        call = next(self._admin_ids)
        answer = self._loop.create_future()
        self._admin_calls[call] = answer
        self._writer.write(frame(("adm", call, op, arg)))
        try:
            result, error = await answer
        finally:
            self._admin_calls.pop(call, None)
        if error is not None:
            raise error
        return result

    def _ack(self) -> None:
        if self._ack_owed:
            self._ack_owed -= 1
        if not self._writer.is_closing():
            self._writer.write(ACK)

    def _cancel(self, key: int) -> None:
        if self._streams.pop(key, None) is not None:
            self._writer.write(frame(("cancel", key)))
        if not self._streams:
            self._idle.set()

    def _stop(self, key: int) -> None:
        if key in self._streams and not self._writer.is_closing():
            self._writer.write(frame(("stop", key)))

    async def _receive(self) -> None:
        streams = self._streams
        try:
            while True:
                msg = await read_frame(self._reader)
                kind = msg[0]
                if kind == "ev":
                    rows = 0
                    for key, tid, text, logprob, special, extra in msg[1]:
                        stream = streams.get(key)
                        if stream is None:
                            continue
                        rows += 1
                        token = TokenInfo(tid, text, logprob, special)
                        if extra is None:
                            stream.push(StepEvent(token))
                        else:
                            stream.push(StepEvent(token, *extra))
                            if extra[2] is not None:
                                del streams[key]
                    if not streams:
                        self._idle.set()
                    # Acknowledged once the events queued here are down to backlog_steps
                    # steps' worth (the streams consume them as gRPC takes their messages):
                    # the engine runs at the pace the streams are written.
                    self._pending += rows
                    self._ack_below = threshold = int(rows * self._backlog_steps)
                    if self._pending <= threshold:
                        self._loop.call_soon(self._ack)
                    else:
                        self._ack_owed += 1
                elif kind == "fail":
                    stream = streams.pop(msg[1], None)
                    if stream is not None:
                        stream.fail(msg[2])
                    if not streams:
                        self._idle.set()
                elif kind == "stats":
                    self._stats = msg[1]
                elif kind == "adapters":
                    self._set_adapters(msg[2])
                    self._writer.write(frame(("adapters_ack", msg[1])))
                elif kind == "admr":
                    answer = self._admin_calls.get(msg[1])
                    if answer is not None and not answer.done():
                        answer.set_result((msg[2], msg[3]))
                elif kind == "unhealthy":
                    self._mark_unhealthy(msg[1])
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            self._mark_unhealthy(f"scheduler process connection lost: {e!r}")

    def _set_adapters(self, adapters: list[AdapterInfo]) -> None:
        kept = {a.name for a in adapters}
        removed = [a.name for a in self._adapters if a.name not in kept]
        self._adapters = list(adapters)
        if self.on_adapter_removed is not None:
            for name in removed:
                self.on_adapter_removed(name)

    def _mark_unhealthy(self, reason: str) -> None:
        if not self.healthy:
            return
        self.healthy = False
        self.unhealthy_reason = reason
        self._fail_all(ShardUnavailableError(f"shard unavailable: {reason}"))
        for answer in self._admin_calls.values():
            if not answer.done():
                answer.set_result((None, ShardUnavailableError(f"shard unavailable: {reason}")))
        if self.on_unhealthy is not None:
            self.on_unhealthy(reason)

    def _fail_all(self, error: EngineError) -> None:
        streams = list(self._streams.items())
        self._streams.clear()  # in place: _receive holds this dict
        for key, stream in streams:
            stream.fail(error)
            if not self._writer.is_closing():
                self._writer.write(frame(("cancel", key)))
        self._idle.set()

    async def drain(self, timeout_s: float) -> bool:
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            self._fail_all(DrainingError("the server is shutting down"))
            return False

    async def stop(self) -> None:
        self.draining = True
        self._fail_all(DrainingError("the server is shutting down"))
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def close(self) -> None:
        await self.stop()


class _RemoteClient:
    """What the router needs of its shard client, in a front end: health and close."""

    def __init__(self, engine: RemoteEngine) -> None:
        self.engine = engine

    async def health(self) -> None:
        if not self.engine.healthy:
            raise ShardRpcError("UNAVAILABLE", self.engine.unhealthy_reason)

    async def close(self) -> None:
        self.engine._writer.close()


@dataclass(frozen=True)
class RemoteEngineSource:
    """service.app.engine_source.EngineSource of a front end: the scheduler process's engine, over its unix
    socket (the shard facts come from the scheduler's hello)."""

    socket_path: str
    backlog_steps: float

    async def connect(self) -> Any:
        reader, writer = await asyncio.open_unix_connection(self.socket_path)
        engine = RemoteEngine(reader, writer, self.backlog_steps)
        warm, shard, limits = await engine.hello()
        engine._adapters = list(shard.adapters)  # until the scheduler's set arrives
        tune_gc()
        return ShardConnection(_RemoteClient(engine), warm, shard, limits)

    def build_engine(
        self,
        connection: Any,
        config: Any,
        on_unhealthy: Any,
        on_adapter_removed: Callable[[str], None] | None = None,
    ) -> RemoteEngine:
        del config  # the scheduler process's engine has its own
        engine: RemoteEngine = connection.client.engine
        engine.on_unhealthy = on_unhealthy
        engine.on_adapter_removed = on_adapter_removed
        return engine


class SharedAdmission:
    """generation.Admission over a counter shared by all front ends: the global
    --max-concurrent-requests."""

    def __init__(self, counter: Any, limit: int) -> None:
        self.counter = counter  # multiprocessing Value("i") with its lock
        self.limit = limit

    def try_enter(self) -> bool:
        with self.counter.get_lock():
            if self.counter.value >= self.limit:
                return False
            self.counter.value += 1
            return True

    def leave(self) -> None:
        with self.counter.get_lock():
            self.counter.value -= 1


def frontend_process(args: argparse.Namespace, socket_path: str, in_flight: Any) -> None:
    """A front end (spawned): the unchanged public router (service.app.serve.serve) over a
    RemoteEngine, on the port it shares with the other front ends."""
    if sys.platform == "linux":  # the scheduler process gone (even SIGKILL): stop too
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    setup_logging(json_output=args.json_output, level=args.log_level)
    source = RemoteEngineSource(socket_path, args.frontend_backlog_steps)
    admission = SharedAdmission(in_flight, args.max_concurrent_requests)
    try:
        code = asyncio.run(
            serve(args, engine_source=source, reuse_port=True, admission=admission)
        )
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)
