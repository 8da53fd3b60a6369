"""Multi-process router: ONE scheduler process beside N streaming front-end processes.

    python -m service.frontend --frontends 2 <the `tokenwire router` flags>

Why: the per-token cost of a grpc.aio stream (one message write, one `sendmsg`, per token) is
paid on the event-loop thread; at batch 256 one Python process cannot stream 20k tokens/s on a
loaded 2-core machine (benchmarks/ROUTER.md). Here the public gRPC work scales out:

- the scheduler process (this module's main) connects to the shards, warms them up and runs the
  one `GenerationEngine` (scheduler, KV blocks, prefix cache, shard RPCs). Front ends talk to it
  over a unix socket: each submitted request travels once (pickled `ValidatedRequest`), and each
  engine step sends each front end ONE frame with the step's rows for its requests
  (`GenerationEngine.submit_to` + an `EventSink`), not one message per token;
- each front-end process runs the unchanged public router (`service.router_main.serve`:
  servicer, interceptors, validation, tokenizer, health, reflection) on the same port
  (SO_REUSEPORT: the kernel spreads connections over the front ends), with a `RemoteEngine`
  in place of the engine.

Differences from `tokenwire router` (which stays the default; nothing else uses this module):
`--max-concurrent-requests` is enforced per front end (pass the total divided by N for the same
global limit; the engine's KV-capacity and overload checks stay global), and `--prometheus-port`
serves the scheduler's engine metrics only (request histograms live in the front ends).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

from service.engine_api import (
    DrainingError,
    EngineError,
    EngineStats,
    ShardUnavailableError,
    StepEvent,
    TokenInfo,
    ValidatedRequest,
)

_log = logging.getLogger("tokenwire.frontend")
_HEADER = struct.Struct("!I")
_STATS_PERIOD_S = 0.25
# Step frames a front end may have unacknowledged before the engine waits for it: the engine
# works on step n+1 while the front ends stream step n, but never runs further ahead (with an
# instant shard it would otherwise finish requests long before their tokens are streamed, and
# spend the CPU the front ends need on ever smaller batches).
_FRAMES_IN_FLIGHT = 2
# A front end acknowledges a step frame once its streams have at most this many steps' worth
# of events queued. More lets each stream write several queued tokens per wakeup (cheaper per
# token), at the cost of the engine's batch (requests finish in the engine before their tokens
# are all written) and of latency.
_BACKLOG_STEPS = float(os.environ.get("TOKENWIRE_FRONTEND_BACKLOG_STEPS", "8"))
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
    """What router_main._watch_shards needs of a health reporter, for the scheduler process."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def serving(self) -> bool:
        return bool(self.engine.healthy)

    def shard_failed(self) -> None:
        if self.engine.healthy:
            self.engine._mark_unhealthy(ShardUnavailableError("shard health check failed"))


async def _scheduler_main(args: argparse.Namespace, extra: list[str]) -> int:
    from service import engine as engine_module
    from service import router_main
    from service.metrics import MetricsServer, ServerMetrics

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    client, warm, shard, limits = await router_main._connect(args, router_main.shard_target(args))
    conns: list[_FrontEndConnection] = []

    def unhealthy(reason: str) -> None:
        for c in conns:
            c.send(("unhealthy", reason))

    engine = engine_module.build_engine(
        client=client,
        warmup=warm,
        shard=shard,
        config=engine_module.EngineConfig(
            max_concurrent_requests=args.max_concurrent_requests
            * args.max_best_of
            * args.frontends,
            max_batch_prefill_tokens=limits.max_batch_prefill_tokens,
            max_batch_total_tokens=args.max_batch_total_tokens,
            max_batch_size=limits.max_batch_size,
            waiting_served_ratio=args.waiting_served_ratio,
            max_waiting_tokens=args.max_waiting_tokens,
        ),
        on_unhealthy=unhealthy,
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
    hello = (warm, shard, limits)

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
        router_main._watch_shards(client, engine, _EngineHealth(engine), stop)
    )
    metrics_server = None
    if args.prometheus_port:
        metrics = ServerMetrics(stats=engine.stats)
        metrics_server = MetricsServer(
            metrics.registry, args.prometheus_port, args.prometheus_hostname
        )
    command = [sys.executable, "-m", "service.frontend", "--role", "frontend",
               "--engine-socket", sock_path, *extra]  # fmt: skip
    children = [subprocess.Popen(command) for _ in range(args.frontends)]  # noqa: ASYNC220 - startup
    _tune_gc()
    code = 0
    try:
        while not stop.is_set():
            dead = [c for c in children if c.poll() is not None]
            if dead:
                _log.error("front end %d exited with %s", dead[0].pid, dead[0].returncode)
                code = 1
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
    finally:
        for c in children:  # they drain their own requests (graceful timeout)
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        deadline = loop.time() + args.graceful_timeout + 10
        while any(c.poll() is None for c in children) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for c in children:
            if c.poll() is None:
                c.kill()
            if c.returncode not in (0, -signal.SIGTERM) and not code:
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


# --- front-end side ------------------------------------------------------------------------------
class _RemoteStream:
    """RequestStream of a request running in the scheduler process."""

    __slots__ = ("_closed", "_engine", "_error", "_events", "_loop", "_waiter", "key")

    def __init__(self, engine: RemoteEngine, key: int, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self.key = key
        self._events: deque[StepEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: EngineError | None = None
        self._closed = False
        self._loop = loop

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def push(self, event: StepEvent) -> None:
        self._events.append(event)
        if self._waiter is not None:
            self._wake()

    def fail(self, error: EngineError) -> None:
        if self._closed:
            return
        self._error = error
        self._closed = True
        self._wake()

    def __aiter__(self) -> _RemoteStream:
        return self

    async def __anext__(self) -> StepEvent:
        while True:
            if self._events:
                event = self._events.popleft()
                engine = self._engine
                engine._pending -= 1
                if engine._ack_owed and engine._pending <= engine._ack_below:
                    engine._ack()
                if event.finished is not None:
                    self._closed = True
                return event
            if self._error is not None:
                err, self._error = self._error, None
                raise err
            if self._closed:
                raise StopAsyncIteration
            self._waiter = self._loop.create_future()
            await self._waiter

    def cancel(self) -> None:
        if self._events:  # never read now
            self._engine._pending -= len(self._events)
            self._events.clear()
        if not self._closed:
            self._closed = True
            self._engine._cancel(self.key)
            self._wake()

    async def aclose(self) -> None:
        self.cancel()


class RemoteEngine:
    """service.engine_api.Engine over the scheduler process's engine (one unix socket)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
                    # Acknowledged once the events queued here are down to _BACKLOG_STEPS
                    # steps' worth (the streams consume them as gRPC takes their messages):
                    # the engine runs at the pace the streams are written.
                    self._pending += rows
                    self._ack_below = threshold = int(rows * _BACKLOG_STEPS)
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


def _frontend_main(args: argparse.Namespace) -> int:
    """The unchanged public router (router_main.serve) over a RemoteEngine, on a shared port."""
    from grpc import aio

    from service import engine as engine_module
    from service import router_main

    holder: dict[str, RemoteEngine] = {}

    async def connect(_args: argparse.Namespace, _target: str) -> Any:
        reader, writer = await asyncio.open_unix_connection(args.engine_socket)
        engine = RemoteEngine(reader, writer)
        holder["engine"] = engine
        warm, shard, limits = await engine.hello()
        _tune_gc()
        return _RemoteClient(engine), warm, shard, limits

    def build_engine(*, on_unhealthy: Any = None, **_: Any) -> RemoteEngine:
        engine = holder["engine"]
        engine.on_unhealthy = on_unhealthy
        return engine

    original_server = aio.server

    def shared_port_server(*a: Any, options: Any = (), **kw: Any) -> Any:
        opts = [o for o in options if o[0] != "grpc.so_reuseport"]
        return original_server(*a, options=[*opts, ("grpc.so_reuseport", 1)], **kw)

    router_main._connect = connect  # type: ignore[assignment]
    engine_module.build_engine = build_engine  # type: ignore[assignment]
    router_main.aio.server = shared_port_server  # type: ignore[attr-defined]
    args.prometheus_port = None  # the scheduler process serves the engine metrics
    return router_main.run(args)


def main(argv: list[str] | None = None) -> int:
    from service import router_main

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    router_main.add_arguments(parser)
    parser.add_argument("--frontends", type=int, default=2, help="front-end processes")
    parser.add_argument("--role", choices=["scheduler", "frontend"], default="scheduler")
    parser.add_argument("--engine-socket", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "frontend":
        return _frontend_main(args)
    from service.logs import setup_logging

    setup_logging(json_output=args.json_output, level=args.log_level)
    extra: list[str] = []  # the front ends get the same flags, less --role
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--role":
            skip = True
        elif not a.startswith("--role="):
            extra.append(a)
    try:
        return asyncio.run(_scheduler_main(args, extra))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
