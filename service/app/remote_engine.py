"""Multi-process router: ONE scheduler process beside N streaming front-end processes.

    tokenwire router --frontends 2 <the other `tokenwire router` flags>
    tokenwire launch --frontends 2 ...

Why: the per-token cost of a grpc.aio stream (one message write, one `sendmsg`, per token) is
paid on the event-loop thread; at batch 256 one Python process cannot stream 20k tokens/s on a
loaded 2-core machine (benchmarks/ROUTER.md). Here the public gRPC work scales out:

- the scheduler process (`run_multiprocess`, what `tokenwire router` runs when --frontends >= 2)
  connects to the shards, warms them up and runs the one `GenerationEngine` (scheduler, KV
  blocks, prefix cache, shard RPCs). Front ends talk to it over a unix socket: each submitted
  request travels once (pickled `ValidatedRequest`), and each engine step sends each front end
  ONE frame with the step's rows for its requests (`GenerationEngine.submit_to` + an
  `EventSink`), not one message per token;
- each front-end process runs the unchanged public router (`service.app.router.serve`:
  servicer, interceptors, validation, tokenizer, health, reflection) on the same port
  (`reuse_port=True`: SO_REUSEPORT, the kernel spreads connections over the front ends), with
  a `RemoteEngineSource` as its engine source: its engine is a `RemoteEngine`.

Limits and metrics across processes: `--max-concurrent-requests` is global — the front ends
share one counter of client requests in flight (`SharedAdmission`, checked at once before
validation, as one process does), and the scheduler's engine keeps its own global limit on
sequences (max-concurrent-requests x max-best-of) and the KV-capacity checks.
`--prometheus-port PORT` serves the scheduler's engine metrics on PORT and front end i's request
metrics on PORT+i (i = 1..N).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

_log = logging.getLogger("tokenwire.frontend")
_HEADER = struct.Struct("!I")
_STATS_PERIOD_S = 0.25
# Step frames a front end may have unacknowledged before the engine waits for it: the engine
# works on step n+1 while the front ends stream step n, but never runs further ahead (with an
# instant shard it would otherwise finish requests long before their tokens are streamed, and
# spend the CPU the front ends need on ever smaller batches).
_FRAMES_IN_FLIGHT = 2
_GATE_TIMEOUT_S = 1.0  # a stuck front end does not stall the others for longer than this


def _frame(message: object) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


_ACK = _frame(("ack",))


async def _read(reader: asyncio.StreamReader) -> Any:
    (n,) = _HEADER.unpack(await reader.readexactly(4))
    return pickle.loads(await reader.readexactly(n))


def _tune_gc() -> None:
    """Long-lived startup objects out of the collector, and fewer gen-0 passes: the hot path
    allocates many short-lived acyclic objects (protos, events)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 50)


# --- scheduler side ----------------------------------------------------------------------------
class _FrontEndConnection:
    """One front end as the engine sees it: an EventSink batching its rows per step."""

    def __init__(self, engine: Any, writer: asyncio.StreamWriter) -> None:
        self.engine = engine
        self.writer = writer
        self.rows: list[object] = []
        self.streams: dict[int, Any] = {}
        self.unacked = 0  # step frames sent and not yet acknowledged
        self.acked = asyncio.Event()

    # EventSink
    def add(self, key: int, event: StepEvent) -> None:
        t = event.token
        if event.top_tokens or event.prefill is not None or event.finished is not None:
            self.rows.append((key, t.id, t.text, t.logprob, t.special,
                              (event.top_tokens, event.prefill, event.finished)))  # fmt: skip
            if event.finished is not None:
                self.streams.pop(key, None)
        else:
            self.rows.append((key, t.id, t.text, t.logprob, t.special, None))

    def flush(self) -> None:
        rows, self.rows = self.rows, []
        self.unacked += 1
        self.send(("ev", rows))

    def fail(self, key: int, error: EngineError) -> None:
        self.streams.pop(key, None)
        self.send(("fail", key, error))

    def send(self, message: object) -> None:
        if not self.writer.is_closing():
            self.writer.write(_frame(message))

    async def serve(self, reader: asyncio.StreamReader, hello: tuple[Any, ...]) -> None:
        engine = self.engine
        try:
            while True:
                msg = await _read(reader)
                kind = msg[0]
                if kind == "sub":
                    key, request = msg[1], msg[2]
                    try:
                        self.streams[key] = engine.submit_to(request, self, key)
                    except EngineError as error:
                        self.send(("fail", key, error))
                elif kind == "ack":
                    self.unacked -= 1
                    self.acked.set()
                elif kind == "cancel":
                    stream = self.streams.pop(msg[1], None)
                    if stream is not None:
                        stream.cancel()
                elif kind == "hello":
                    self.send(("hello", *hello))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:  # the front end went away: its requests free their blocks
            self.unacked = 0
            self.acked.set()
            for stream in self.streams.values():
                stream.cancel()
            self.streams.clear()


class _EngineHealth:
    """What router_main.watch_shards needs of a health reporter, for the scheduler process."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def serving(self) -> bool:
        return bool(self.engine.healthy)

    def shard_failed(self) -> None:
        if self.engine.healthy:
            self.engine._mark_unhealthy(ShardUnavailableError("shard health check failed"))


def _free_port(host: str) -> int:
    """A port for the front ends to share when --port is 0 (each would pick its own)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host.strip("[]"), 0))
        return int(sock.getsockname()[1])


def _frontend_args(args: argparse.Namespace, index: int, port: int) -> argparse.Namespace:
    """Front end `index` (1-based): the router flags, the shared port, its own metrics port."""
    child = argparse.Namespace(**vars(args))
    child.port = port
    if args.prometheus_port:
        child.prometheus_port = args.prometheus_port + index
    return child


async def _scheduler_main(args: argparse.Namespace) -> int:
    from service.app import router as router_main
    from service.observability.metrics import MetricsServer, ServerMetrics

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    source = router_main.ShardEngineSource(args)
    connection = await source.connect()
    client = connection.client
    conns: list[_FrontEndConnection] = []

    def unhealthy(reason: str) -> None:
        for c in conns:
            c.send(("unhealthy", reason))

    # The global limit on sequences (as in one process); the client-request limit is the
    # front ends' SharedAdmission.
    engine = source.build_engine(
        connection, router_main.engine_config(args, connection.limits), unhealthy
    )

    async def gate() -> None:
        for c in conns:
            while c.unacked >= _FRAMES_IN_FLIGHT:
                c.acked.clear()
                try:
                    await asyncio.wait_for(c.acked.wait(), _GATE_TIMEOUT_S)
                except TimeoutError:
                    break

    engine.step_gate = gate
    await engine.start()
    hello = (connection.warmup, connection.shard, connection.limits)

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _FrontEndConnection(engine, writer)
        conns.append(conn)
        try:
            await conn.serve(reader, hello)
        finally:
            conns.remove(conn)
            writer.close()

    sock_dir = Path(tempfile.mkdtemp(prefix="tokenwire-engine-"))
    sock_path = str(sock_dir / "engine.sock")
    server = await asyncio.start_unix_server(on_connect, sock_path)

    async def push_stats() -> None:
        while True:
            await asyncio.sleep(_STATS_PERIOD_S)
            if conns:
                stats = engine.stats()
                for c in conns:
                    c.send(("stats", stats))

    stats_task = asyncio.ensure_future(push_stats())
    watch = asyncio.ensure_future(
        router_main.watch_shards(client, engine, _EngineHealth(engine), stop)
    )
    metrics_server = None
    if args.prometheus_port:
        metrics = ServerMetrics(stats=engine.stats)
        metrics_server = MetricsServer(
            metrics.registry, args.prometheus_port, args.prometheus_hostname
        )
    port = args.port or _free_port(args.hostname)
    ctx = multiprocessing.get_context("spawn")
    in_flight = ctx.Value("i", 0)  # client requests admitted by all front ends
    children = [
        ctx.Process(
            target=_frontend_process,
            args=(_frontend_args(args, i, port), sock_path, in_flight),
            name=f"tokenwire-frontend-{i}",
        )
        for i in range(1, args.frontends + 1)
    ]
    for child in children:
        child.start()
    _log.info("scheduler process: %d front ends on %s:%d", args.frontends, args.hostname, port)
    _tune_gc()
    code = 0
    try:
        while not stop.is_set():
            dead = [c for c in children if c.exitcode is not None]
            if dead:
                _log.error("front end %d exited with %s", dead[0].pid, dead[0].exitcode)
                code = 1
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
    finally:
        for c in children:  # they drain their own requests (graceful timeout)
            if c.exitcode is None:
                c.terminate()
        deadline = loop.time() + args.graceful_timeout + 10
        while any(c.exitcode is None for c in children) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for c in children:
            if c.exitcode is None:
                c.kill()
                c.join(5)
            if c.exitcode not in (0, -signal.SIGTERM) and not code:
                code = 1
        watch.cancel()
        stats_task.cancel()
        server.close()
        await engine.close()
        await client.close()
        if metrics_server is not None:
            metrics_server.close()
        with contextlib.suppress(OSError):
            os.unlink(sock_path)
            sock_dir.rmdir()
    return code


def run_multiprocess(args: argparse.Namespace) -> int:
    """`tokenwire router --frontends N` (N >= 2): the scheduler process; it starts the front
    ends and exits when one of them dies or on SIGTERM/SIGINT (after they drain)."""
    from service.observability.logs import setup_logging

    setup_logging(json_output=args.json_output, level=args.log_level)
    try:
        return asyncio.run(_scheduler_main(args))
    except KeyboardInterrupt:
        return 130


# --- front-end side ------------------------------------------------------------------------------
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
        self._pending = 0  # events received and not yet read by their stream
        self._ack_owed = 0  # step frames to acknowledge once _pending <= _ack_below
        self._ack_below = 0
        # A step frame is acknowledged once the streams here have at most this many steps'
        # worth of events queued (--frontend-backlog-steps).
        self._backlog_steps = backlog_steps

    async def hello(self) -> tuple[Any, Any, Any]:
        self._writer.write(_frame(("hello",)))
        msg = await _read(self._reader)
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
        self._writer.write(_frame(("sub", key, request)))
        return stream

    def stats(self) -> EngineStats:
        return self._stats

    def _ack(self) -> None:
        if self._ack_owed:
            self._ack_owed -= 1
        if not self._writer.is_closing():
            self._writer.write(_ACK)

    def _cancel(self, key: int) -> None:
        if self._streams.pop(key, None) is not None:
            self._writer.write(_frame(("cancel", key)))
        if not self._streams:
            self._idle.set()

    async def _receive(self) -> None:
        streams = self._streams
        try:
            while True:
                msg = await _read(self._reader)
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
                elif kind == "unhealthy":
                    self._mark_unhealthy(msg[1])
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            self._mark_unhealthy(f"scheduler process connection lost: {e!r}")

    def _mark_unhealthy(self, reason: str) -> None:
        if not self.healthy:
            return
        self.healthy = False
        self.unhealthy_reason = reason
        self._fail_all(ShardUnavailableError(f"shard unavailable: {reason}"))
        if self.on_unhealthy is not None:
            self.on_unhealthy(reason)

    def _fail_all(self, error: EngineError) -> None:
        streams = list(self._streams.items())
        self._streams.clear()  # in place: _receive holds this dict
        for key, stream in streams:
            stream.fail(error)
            if not self._writer.is_closing():
                self._writer.write(_frame(("cancel", key)))
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
            import grpc
            from grpc import aio

            raise aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                aio.Metadata(),
                aio.Metadata(),
                details=self.engine.unhealthy_reason,
            )

    async def close(self) -> None:
        self.engine._writer.close()


@dataclass(frozen=True)
class RemoteEngineSource:
    """router_main.EngineSource of a front end: the scheduler process's engine, over its unix
    socket (the shard facts come from the scheduler's hello)."""

    socket_path: str
    backlog_steps: float

    async def connect(self) -> Any:
        from service.app.router import ShardConnection

        reader, writer = await asyncio.open_unix_connection(self.socket_path)
        engine = RemoteEngine(reader, writer, self.backlog_steps)
        warm, shard, limits = await engine.hello()
        _tune_gc()
        return ShardConnection(_RemoteClient(engine), warm, shard, limits)

    def build_engine(self, connection: Any, config: Any, on_unhealthy: Any) -> RemoteEngine:
        del config  # the scheduler process's engine has its own
        engine: RemoteEngine = connection.client.engine
        engine.on_unhealthy = on_unhealthy
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


def _frontend_process(args: argparse.Namespace, socket_path: str, in_flight: Any) -> None:
    """A front end (spawned): the unchanged public router (router_main.serve) over a
    RemoteEngine, on the port it shares with the other front ends."""
    from service.app import router as router_main
    from service.observability.logs import setup_logging

    if sys.platform == "linux":  # the scheduler process gone (even SIGKILL): stop too
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    setup_logging(json_output=args.json_output, level=args.log_level)
    source = RemoteEngineSource(socket_path, args.frontend_backlog_steps)
    admission = SharedAdmission(in_flight, args.max_concurrent_requests)
    try:
        code = asyncio.run(
            router_main.serve(args, engine_source=source, reuse_port=True, admission=admission)
        )
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)
