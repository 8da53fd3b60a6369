"""Multi-process router: ONE scheduler process beside N streaming front-end processes.

    tokenwire router --frontends 2 <the other `tokenwire router` flags>
    tokenwire launch --frontends 2 ...

Why: the per-token cost of a grpc.aio stream (one message write, one `sendmsg`, per token) is
paid on the event-loop thread; at batch 256 one Python process cannot stream 20k tokens/s on a
loaded 2-core machine (benchmarks/ROUTER.md). Here the public gRPC work scales out:

- the scheduler process (`run_multiprocess`, what `tokenwire router` runs when --frontends >= 2)
  connects to the shards, warms them up and runs the one `LocalEngine` (scheduler, KV
  blocks, prefix cache, shard RPCs). Front ends talk to it over a unix socket: each submitted
  request travels once (pickled `ValidatedRequest`), and each engine step sends each front end
  ONE frame with the step's rows for its requests (`LocalEngine.submit_to` + an
  `EventSink`), not one message per token;
- each front-end process runs the unchanged public router (`service.app.serve.serve`:
  servicer, interceptors, validation, tokenizer, health, reflection) on the same port
  (`reuse_port=True`: SO_REUSEPORT, the kernel spreads connections over the front ends), with
  a `RemoteEngineSource` as its engine source: its engine is a `RemoteEngine`.

Limits and metrics across processes: `--max-concurrent-requests` is global — the front ends
share one counter of client requests in flight (`SharedAdmission`, checked at once before
validation, as one process does), and the scheduler's engine keeps its own global limit on
sequences (max-concurrent-requests x max-best-of) and the KV-capacity checks.
`--prometheus-port PORT` serves front end i's request metrics on PORT+i (i = 1..N), and on PORT
the scheduler's engine metrics, `tokenwire_serving` and the front ends' request metrics summed
(service.observability.merged_metrics): one scrape of PORT sees the whole router, as with one
process.

LoRA admin (LoadAdapter / UnloadAdapter, REST /info/loras) reaching any front end is forwarded
over its socket and run on the engine here; the resulting adapter set goes to every front end,
and the call is answered once each has acknowledged it (`_AdapterSets`), so right after it
returns every front end lists and admits the same adapters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from service.app.engine_link import frame, read_frame
from service.app.engine_source import ShardEngineSource
from service.app.ports import free_port
from service.app.remote_engine import frontend_process
from service.app.router_flags import engine_config
from service.app.serve import watch_shards
from service.engine.contracts import EngineError, ShardUnavailableError, StepEvent
from service.observability.logs import setup_logging
from service.observability.merged_metrics import MergedMetrics
from service.observability.metrics import PREFIX, EngineCollector, MetricsServer

_log = logging.getLogger("tokenwire.frontend")
_STATS_PERIOD_S = 0.25
# Step frames a front end may have unacknowledged before the engine waits for it: the engine
# works on step n+1 while the front ends stream step n, but never runs further ahead (with an
# instant shard it would otherwise finish requests long before their tokens are streamed, and
# spend the CPU the front ends need on ever smaller batches).
_FRAMES_IN_FLIGHT = 2
_GATE_TIMEOUT_S = 1.0  # a stuck front end does not stall the others for longer than this


_ADAPTERS_ACK_TIMEOUT_S = 5.0  # a stuck front end does not hold an admin call longer


class _AdapterSets:
    """Publishes the engine's LoRA adapter set to every front end after an admin call, and waits
    until each acknowledged it: once a LoadAdapter / UnloadAdapter call returns, every front end
    validates requests and lists models against the new set."""

    def __init__(self, engine: Any, conns: list[_FrontEndConnection]) -> None:
        self.engine = engine
        self.conns = conns
        self.version = 0

    def send_to(self, conn: _FrontEndConnection) -> None:
        conn.send(("adapters", self.version, self.engine.list_adapters()))

    async def publish(self, wait: bool = True) -> None:
        self.version += 1
        version = self.version
        for c in self.conns:
            self.send_to(c)
        if not wait:
            return
        deadline = asyncio.get_running_loop().time() + _ADAPTERS_ACK_TIMEOUT_S
        for c in list(self.conns):
            while c.adapters_version < version and c in self.conns:
                c.adapters_acked.clear()
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    _log.warning("a front end did not acknowledge adapter set %d", version)
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(c.adapters_acked.wait(), remaining)


class _FrontEndConnection:
    """One front end as the engine sees it: an EventSink batching its rows per step."""

    def __init__(
        self, engine: Any, writer: asyncio.StreamWriter, adapter_sets: _AdapterSets | None = None
    ) -> None:
        self.engine = engine
        self.writer = writer
        self.rows: list[object] = []
        self.streams: dict[int, Any] = {}
        self.unacked = 0  # step frames sent and not yet acknowledged
        self.acked = asyncio.Event()
        self.adapter_sets = adapter_sets
        self.adapters_version = 0  # the last adapter set this front end acknowledged
        self.adapters_acked = asyncio.Event()
        self._admin_tasks: set[asyncio.Task[None]] = set()

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
            self.writer.write(frame(message))

    async def serve(
        self,
        reader: asyncio.StreamReader,
        hello: tuple[Any, ...],
        on_hello: Callable[[], None] = lambda: None,
    ) -> None:
        """Serves one front end's frames until it goes away. `on_hello` runs right after the
        hello answer is written: the caller registers the connection for broadcasts (stats,
        adapter sets, health) only then, so nothing reaches a front end before its hello (a
        loaded CI run saw a stats frame arrive first and the front end exit)."""
        engine = self.engine
        try:
            while True:
                msg = await read_frame(reader)
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
                elif kind == "stop":  # a stop sequence matched in the front end
                    stream = self.streams.get(msg[1])
                    if stream is not None:
                        stream.stop()
                elif kind == "hello":
                    self.send(("hello", *hello))
                    on_hello()
                    if self.adapter_sets is not None:
                        self.adapter_sets.send_to(self)  # the set as it is now
                elif kind == "adapters_ack":
                    self.adapters_version = max(self.adapters_version, msg[1])
                    self.adapters_acked.set()
                elif kind == "adm":
                    task = asyncio.ensure_future(self._admin(msg[1], msg[2], msg[3]))
                    self._admin_tasks.add(task)
                    task.add_done_callback(self._admin_tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:  # the front end went away: its requests free their blocks
            self.unacked = 0
            self.acked.set()
            self.adapters_acked.set()
            for stream in self.streams.values():
                stream.cancel()
            self.streams.clear()


    async def _admin(self, call: int, op: str, arg: Any) -> None:
        """A LoRA admin call forwarded by this front end, run on the engine here; every front
        end has the resulting adapter set before the answer goes back."""
        result: Any = None
        error: BaseException | None = None
        try:
            if op == "load":
                result = await self.engine.load_adapters(arg)
            elif op == "unload":
                task = asyncio.ensure_future(self.engine.unload_adapter(arg))
                await asyncio.sleep(0)  # the name stops being admitted at once ...
                if not task.done() and self.adapter_sets is not None:
                    await self.adapter_sets.publish(wait=False)  # ... on every front end
                await task
            else:
                error = EngineError(f"unknown admin call {op!r}")
        except Exception as e:  # noqa: BLE001 - handed to the calling front end, which raises it
            error = e
        if self.adapter_sets is not None:
            await self.adapter_sets.publish()
        try:
            self.send(("admr", call, result, error))
        except Exception as e:  # noqa: BLE001 - an error that does not pickle
            self.send(("admr", call, None, EngineError(f"{type(e).__name__}: {error}")))


class _EngineHealth:
    """What service.app.serve.watch_shards needs of a health reporter, for the scheduler process."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def serving(self) -> bool:
        return bool(self.engine.healthy)

    def shard_failed(self) -> None:
        if self.engine.healthy:
            self.engine._mark_unhealthy(ShardUnavailableError("shard health check failed"))


def _frontend_args(args: argparse.Namespace, index: int, port: int) -> argparse.Namespace:
    """Front end `index` (1-based): the router flags, the shared port, its own metrics port."""
    child = argparse.Namespace(**vars(args))
    child.port = port
    if args.prometheus_port:
        child.prometheus_port = args.prometheus_port + index
        # GET /metrics through Envoy answers the merged text this process serves on PORT.
        child.merged_metrics_url = f"http://{_metrics_host(args)}:{args.prometheus_port}/metrics"
    return child


def _metrics_host(args: argparse.Namespace) -> str:
    """Where this host's --prometheus-hostname listener is reached (a wildcard: loopback)."""
    host = args.prometheus_hostname
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"[{host}]" if ":" in host else host


def _scheduler_registry(args: argparse.Namespace, engine: Any) -> tuple[CollectorRegistry, Gauge]:
    """What PORT serves: the engine's metrics, `serving`, and the front ends' request metrics
    summed (read from PORT+1 .. PORT+N at each scrape), so one scrape sees every request."""
    registry = CollectorRegistry()
    engine_metrics = EngineCollector(engine.stats)
    registry.register(engine_metrics)
    serving = Gauge(f"{PREFIX}_serving", "1 while health is SERVING, 0 otherwise",
                    registry=registry)  # fmt: skip
    host = _metrics_host(args)
    urls = [
        f"http://{host}:{args.prometheus_port + i}/metrics" for i in range(1, args.frontends + 1)
    ]
    own = {f"{PREFIX}_serving"}
    registry.register(
        MergedMetrics(urls, lambda: own | {m.name for m in engine_metrics.collect()})
    )
    return registry, serving


async def _scheduler_main(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    source = ShardEngineSource(args, pace_gc=True)
    connection = await source.connect()
    client = connection.client
    conns: list[_FrontEndConnection] = []

    def unhealthy(reason: str) -> None:
        for c in conns:
            c.send(("unhealthy", reason))

    # The global limit on sequences (as in one process); the client-request limit is the
    # front ends' SharedAdmission.
    engine = source.build_engine(
        connection, engine_config(args, connection.limits), unhealthy
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

    adapter_sets = _AdapterSets(engine, conns)

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _FrontEndConnection(engine, writer, adapter_sets)
        try:
            await conn.serve(reader, hello, on_hello=lambda: conns.append(conn))
        finally:
            if conn in conns:
                conns.remove(conn)
            writer.close()

    sock_dir = Path(tempfile.mkdtemp(prefix="tokenwire-engine-"))
    sock_path = str(sock_dir / "engine.sock")
    server = await asyncio.start_unix_server(on_connect, sock_path)

    metrics_server = None
    serving: Gauge | None = None
    if args.prometheus_port:
        registry, serving = _scheduler_registry(args, engine)
        metrics_server = MetricsServer(registry, args.prometheus_port, args.prometheus_hostname)

    async def push_stats() -> None:
        while True:
            if serving is not None:  # what an endpoint picker scraping PORT reads
                serving.set(1.0 if engine.healthy and not stop.is_set() else 0.0)
            await asyncio.sleep(_STATS_PERIOD_S)
            if conns:
                stats = engine.stats()
                for c in conns:
                    c.send(("stats", stats))

    stats_task = asyncio.ensure_future(push_stats())
    watch = asyncio.ensure_future(
        watch_shards(client, engine, _EngineHealth(engine), stop)
    )
    port = args.port or free_port(args.hostname)
    ctx = multiprocessing.get_context("spawn")
    in_flight = ctx.Value("i", 0)  # client requests admitted by all front ends
    children = [
        ctx.Process(
            target=frontend_process,
            args=(_frontend_args(args, i, port), sock_path, in_flight),
            name=f"tokenwire-frontend-{i}",
        )
        for i in range(1, args.frontends + 1)
    ]
    for child in children:
        child.start()
    _log.info("scheduler process: %d front ends on %s:%d", args.frontends, args.hostname, port)
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
    setup_logging(json_output=args.json_output, level=args.log_level)
    try:
        return asyncio.run(_scheduler_main(args))
    except KeyboardInterrupt:
        return 130


