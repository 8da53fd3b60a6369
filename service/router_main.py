"""`tokenwire router`: serve the public gRPC API in front of running shards.

Startup: connect to rank 0 (which names the other ranks), read Info, Warmup with the budgets,
build the engine, then serve `tokenwire.v1.TextGeneration`, `grpc.health.v1.Health` (NOT_SERVING
until warm) and server reflection. SIGTERM/SIGINT: NOT_SERVING, drain up to --graceful-timeout,
stop. Flags fall back to the environment variables TGI users know (PORT, MAX_INPUT_TOKENS, ...).

`--frontends N` (N >= 2) runs the same public router in N front-end processes sharing the port
(SO_REUSEPORT) beside one scheduler process that owns the engine: see service/frontend.py.
`serve` takes where its engine comes from as an `EngineSource` (default: the shards themselves,
`ShardEngineSource`), which is how the front ends plug in theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from grpc import aio

from service.env_flags import env_bool, env_value

if TYPE_CHECKING:
    from service.engine import EngineConfig
    from service.engine_api import Engine
    from service.generation import Admission

DEFAULT_SHARD_UDS_PATH = "/tmp/tokenwire-shard"
# TGI's defaults: max_total_tokens = min(max_position_embeddings, 4096), max_input = total - 1.
DEFAULT_TOTAL_TOKENS_CAP = 4096
_log = logging.getLogger("tokenwire.router")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `tokenwire router` (defaults read the environment when the parser is built)."""
    parser.description = __doc__.splitlines()[0]
    a = parser.add_argument
    a(
        "--hostname",
        default=env_value("HOSTNAME") or "127.0.0.1",
        help="address the gRPC server listens on [HOSTNAME] (default 127.0.0.1)",
    )
    a(
        "--port",
        type=int,
        default=int(env_value("PORT") or 50051),
        help="gRPC port; 0 picks a free one [PORT] (default 50051)",
    )
    a(
        "--shard-uds-path",
        default=env_value("SHARD_UDS_PATH"),
        help="unix socket prefix of the shards: rank 0 listens on unix://PREFIX-0 and names the "
        f"others [SHARD_UDS_PATH] (default {DEFAULT_SHARD_UDS_PATH})",
    )
    a(
        "--shard-address",
        default=env_value("SHARD_ADDRESS"),
        help="HOST:PORT of shard rank 0 instead of a unix socket [SHARD_ADDRESS]",
    )
    a(
        "--model-id",
        default=env_value("MODEL_ID"),
        help="model id reported by Info (default: what the shard reports) [MODEL_ID]",
    )
    a(
        "--tokenizer",
        type=Path,
        default=env_value("TOKENIZER"),
        help="directory holding tokenizer.json, or the file (default: the resolved --model-id "
        "directory, else the shard's model directory) [TOKENIZER]",
    )
    a(
        "--max-concurrent-requests",
        type=int,
        default=int(env_value("MAX_CONCURRENT_REQUESTS") or 128),
        help="client requests in flight (queued or running) before RESOURCE_EXHAUSTED; with "
        "--frontends N the limit is global: the front ends share one counter of admitted "
        "requests, so the excess is refused at once whichever front end it reaches "
        "[MAX_CONCURRENT_REQUESTS] (default 128)",
    )
    a(
        "--max-best-of",
        type=int,
        default=int(env_value("MAX_BEST_OF") or 2),
        help="largest best_of a request may ask for [MAX_BEST_OF] (default 2)",
    )
    a(
        "--max-stop-sequences",
        type=int,
        default=int(env_value("MAX_STOP_SEQUENCES") or 4),
        help="most stop sequences per request [MAX_STOP_SEQUENCES] (default 4)",
    )
    a(
        "--max-top-n-tokens",
        type=int,
        default=int(env_value("MAX_TOP_N_TOKENS") or 5),
        help="largest top_n_tokens per request [MAX_TOP_N_TOKENS] (default 5)",
    )
    a(
        "--max-input-tokens",
        type=int,
        default=_opt_int("MAX_INPUT_TOKENS", "MAX_INPUT_LENGTH"),
        help="longest prompt in tokens, after truncation [MAX_INPUT_TOKENS] (default "
        "max-total-tokens - 1)",
    )
    a(
        "--max-total-tokens",
        type=int,
        default=_opt_int("MAX_TOTAL_TOKENS"),
        help="prompt + generated tokens of one request [MAX_TOTAL_TOKENS] (default "
        f"min(max_position_embeddings, {DEFAULT_TOTAL_TOKENS_CAP}), or max-input-tokens + 1 "
        "when only that is set)",
    )
    a(
        "--max-client-batch-size",
        type=int,
        default=int(env_value("MAX_CLIENT_BATCH_SIZE") or 4),
        help="most inputs in one client batch (reported by Info) [MAX_CLIENT_BATCH_SIZE] "
        "(default 4)",
    )
    a(
        "--validation-workers",
        type=int,
        default=int(env_value("VALIDATION_WORKERS") or 2),
        help="tokenizer threads [VALIDATION_WORKERS] (default 2)",
    )
    a(
        "--max-batch-prefill-tokens",
        type=int,
        default=_opt_int("MAX_BATCH_PREFILL_TOKENS"),
        help="most prompt tokens computed in one step (longer prompts are chunked) "
        "[MAX_BATCH_PREFILL_TOKENS] (default max-input-tokens + 50)",
    )
    a(
        "--max-batch-total-tokens",
        type=int,
        default=_opt_int("MAX_BATCH_TOTAL_TOKENS"),
        help="cap on the KV cache in tokens, all requests together [MAX_BATCH_TOTAL_TOKENS] "
        "(default: what fits, found by warmup)",
    )
    a(
        "--max-batch-size",
        type=int,
        default=_opt_int("MAX_BATCH_SIZE"),
        help="most requests in one step [MAX_BATCH_SIZE] (default max-concurrent-requests x "
        "max-best-of)",
    )
    a(
        "--waiting-served-ratio",
        type=float,
        default=float(env_value("WAITING_SERVED_RATIO") or 0.3),
        help="admit waiting requests into a running batch when waiting/running exceeds this "
        "[WAITING_SERVED_RATIO] (default 0.3)",
    )
    a(
        "--max-waiting-tokens",
        type=int,
        default=int(env_value("MAX_WAITING_TOKENS") or 20),
        help="decode steps a waiting request may wait before forcing a prefill "
        "[MAX_WAITING_TOKENS] (default 20)",
    )
    a(
        "--prometheus-port",
        type=int,
        default=int(env_value("PROMETHEUS_PORT") or 0),
        help="serve Prometheus metrics at http://HOSTNAME:PORT/metrics; 0 = off. With "
        "--frontends N: PORT serves the scheduler process (engine metrics: KV blocks, queue, "
        "batch, scheduler CPU) and PORT+1 .. PORT+N serve front end 1 .. N (request metrics: "
        "counts, latencies, tokens, in flight; their engine gauges are copies of the "
        "scheduler's, refreshed every 0.25 s) [PROMETHEUS_PORT] (default 0)",
    )
    a(
        "--prometheus-hostname",
        default=env_value("PROMETHEUS_HOSTNAME") or "0.0.0.0",
        help="address of the metrics endpoint [PROMETHEUS_HOSTNAME] (default 0.0.0.0)",
    )
    a(
        "--api-key",
        default=env_value("API_KEY"),
        help="require 'authorization: Bearer KEY' metadata on generation calls (health and "
        "reflection stay open) [API_KEY]",
    )
    a(
        "--json-output",
        action="store_true",
        default=env_bool("JSON_OUTPUT"),
        help="log one JSON object per line [JSON_OUTPUT]",
    )
    a("--log-level", default=env_value("LOG_LEVEL") or "INFO", help="[LOG_LEVEL] (default INFO)")
    a(
        "--graceful-timeout",
        type=float,
        default=float(env_value("GRACEFUL_TIMEOUT") or 30.0),
        help="seconds to finish in-flight requests after SIGTERM [GRACEFUL_TIMEOUT] (default 30)",
    )
    a("--startup-timeout", type=float, default=float(env_value("STARTUP_TIMEOUT") or 600.0),
      help="seconds to wait for the shards to answer and warm up (default 600)")  # fmt: skip
    a(
        "--frontends",
        type=int,
        default=int(env_value("FRONTENDS") or 1),
        help="public gRPC processes. 1: one process runs everything. N >= 2: one scheduler "
        "process runs the engine and N front-end processes (validation, tokenization, "
        "streaming) share --port through SO_REUSEPORT; streaming many tokens/s then uses more "
        "than one core (benchmarks/ROUTER.md) [FRONTENDS] (default 1)",
    )
    a(
        "--frontend-backlog-steps",
        type=float,
        default=float(env_value("FRONTEND_BACKLOG_STEPS") or 8.0),
        help="with --frontends N >= 2: steps' worth of token events a front end may hold "
        "unwritten before it lets the engine run further ahead. More: each stream writes "
        "several queued tokens per wakeup (less CPU per token), but requests finish in the "
        "engine before their tokens are written (smaller batches) and tokens wait longer. "
        "Fewer: tighter pacing, more CPU per token [FRONTEND_BACKLOG_STEPS] (default 8)",
    )


def _opt_int(*names: str) -> int | None:
    value = env_value(*names)
    return None if value is None else int(value)


@dataclass(frozen=True)
class Limits:
    """Token limits after defaults are resolved against the model."""

    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_size: int


def resolve_limits(args: argparse.Namespace, max_position_embeddings: int) -> Limits:
    """Fills the token limits the user left unset (TGI's rules) and checks them."""
    total = args.max_total_tokens
    inputs = args.max_input_tokens
    if total is None:
        total = (
            inputs + 1
            if inputs is not None
            and inputs + 1 > min(max_position_embeddings, DEFAULT_TOTAL_TOKENS_CAP)
            else min(max_position_embeddings, DEFAULT_TOTAL_TOKENS_CAP)
        )
    if inputs is None:
        inputs = total - 1
    if not 0 < inputs < total:
        raise SystemExit(
            f"--max-input-tokens ({inputs}) must be > 0 and < --max-total-tokens ({total})"
        )
    if total > max_position_embeddings:
        raise SystemExit(
            f"--max-total-tokens ({total}) must be <= the model's max_position_embeddings "
            f"({max_position_embeddings})"
        )
    prefill = args.max_batch_prefill_tokens
    if prefill is None:
        prefill = inputs + 50
    batch_size = args.max_batch_size or args.max_concurrent_requests * args.max_best_of
    return Limits(inputs, total, prefill, batch_size)


@dataclass(frozen=True)
class ShardConnection:
    """What connecting to the shards yields: the client the router health-checks and closes,
    the Warmup answer (`shard_convert.WarmupInfo`), the shard's `ShardInfo`, resolved limits."""

    client: Any
    warmup: Any
    shard: Any
    limits: Limits


class EngineSource(Protocol):
    """Where `serve` gets its engine: connect (and warm up), then build the engine."""

    async def connect(self) -> ShardConnection:
        """Waits until the engine's backend is ready; raises when it cannot be reached."""
        ...

    def build_engine(
        self,
        connection: ShardConnection,
        config: EngineConfig,
        on_unhealthy: Callable[[str], None],
    ) -> Engine:
        """The engine to serve with (`start()`, `drain()`, `close()` are called by serve);
        `on_unhealthy(reason)` is called when its backend fails."""
        ...


@dataclass(frozen=True)
class ShardEngineSource:
    """The default EngineSource: the shards themselves and an in-process GenerationEngine."""

    args: argparse.Namespace

    async def connect(self) -> ShardConnection:
        client, warm, shard, limits = await _connect(self.args, shard_target(self.args))
        return ShardConnection(client, warm, shard, limits)

    def build_engine(
        self,
        connection: ShardConnection,
        config: EngineConfig,
        on_unhealthy: Callable[[str], None],
    ) -> Any:
        from service import engine as engine_module

        return engine_module.build_engine(
            client=connection.client,
            warmup=connection.warmup,
            shard=connection.shard,
            config=config,
            on_unhealthy=on_unhealthy,
        )


def engine_config(args: argparse.Namespace, limits: Limits) -> EngineConfig:
    """The engine's limits from the router flags and the resolved token limits."""
    from service.engine import EngineConfig

    return EngineConfig(
        # best_of expands one client request into up to max_best_of sequences; the
        # client-request limit is enforced by GenerationService.
        max_concurrent_requests=args.max_concurrent_requests * args.max_best_of,
        max_batch_prefill_tokens=limits.max_batch_prefill_tokens,
        max_batch_total_tokens=args.max_batch_total_tokens,
        max_batch_size=limits.max_batch_size,
        waiting_served_ratio=args.waiting_served_ratio,
        max_waiting_tokens=args.max_waiting_tokens,
    )


def shard_target(args: argparse.Namespace) -> str:
    """gRPC target of shard rank 0."""
    if args.shard_address:
        return args.shard_address
    return f"unix://{args.shard_uds_path or DEFAULT_SHARD_UDS_PATH}-0"


def _tokenizer_path(args: argparse.Namespace, shard_model_id: str) -> Path:
    if args.tokenizer is not None:
        return Path(args.tokenizer)
    from shard.tools.download import resolve_model

    return resolve_model(args.model_id or shard_model_id)


def build_server(
    servicer: Any,
    health_reporter: Any,
    *,
    host: str,
    port: int,
    api_key: str | None,
    reuse_port: bool = False,
) -> tuple[aio.Server, int]:
    """The public gRPC server (not started): TextGeneration, grpc.health.v1 and reflection of
    every service, behind the interceptors. Returns it with its bound port. `reuse_port`:
    several processes listen on the port (SO_REUSEPORT) and the kernel spreads connections."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection
    from tokenwire.v1 import generate_pb2_grpc

    from service.interceptors import server_interceptors
    from service.servicer import SERVICE_NAME

    server = aio.server(
        interceptors=server_interceptors(api_key),
        options=[
            ("grpc.so_reuseport", int(reuse_port)),
            ("grpc.max_receive_message_length", 16 << 20),
            ("grpc.max_send_message_length", 64 << 20),
        ],
    )
    generate_pb2_grpc.add_TextGenerationServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_reporter.servicer, server)
    services = (
        SERVICE_NAME,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(services, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise SystemExit(f"cannot listen on {host}:{port}")
    return server, bound


async def serve(
    args: argparse.Namespace,
    *,
    on_listening: Callable[[int], Awaitable[None] | None] | None = None,
    stop: asyncio.Event | None = None,
    engine_source: EngineSource | None = None,
    reuse_port: bool = False,
    admission: Admission | None = None,
) -> int:
    """Runs the router until SIGTERM/SIGINT (or `stop`); returns the exit code.

    `engine_source`: where the engine comes from (default `ShardEngineSource(args)`);
    `reuse_port`: share the port with other processes (SO_REUSEPORT); `admission`: a counter of
    client requests in flight shared with other processes, checked beside the local limit."""
    from service.generation import GenerationService, ServerInfo
    from service.metrics import MetricsServer, ServerMetrics
    from service.servicer import HealthReporter, TextGenerationServicer
    from service.tokenization import TokenizerPool
    from service.validation import ValidationLimits, Validator

    stop = stop or asyncio.Event()
    source = engine_source if engine_source is not None else ShardEngineSource(args)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass

    # Serve health (NOT_SERVING) and reflection while the shards warm up, so probes get answers.
    holder: dict[str, Any] = {}
    metrics = ServerMetrics(
        stats=lambda: holder["engine"].stats() if "engine" in holder else _no_stats()
    )
    health_reporter = HealthReporter(metrics)
    await health_reporter.start()
    servicer = TextGenerationServicer(None, health_reporter)
    server, port = build_server(
        servicer,
        health_reporter,
        host=args.hostname,
        port=args.port,
        api_key=args.api_key,
        reuse_port=reuse_port,
    )
    await server.start()
    _log.info("listening on %s:%d (NOT_SERVING until the shards are warm)", args.hostname, port)
    if on_listening is not None:
        maybe = on_listening(port)
        if maybe is not None:
            await maybe
    metrics_server = None
    if args.prometheus_port:
        metrics_server = MetricsServer(
            metrics.registry, args.prometheus_port, args.prometheus_hostname
        )
        _log.info("metrics on http://%s:%d/metrics", args.prometheus_hostname, metrics_server.port)

    client = None
    engine = None
    tokenizer = None
    try:
        connect_task = asyncio.ensure_future(source.connect())
        stop_task = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({connect_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if connect_task not in done:
            connect_task.cancel()
            _log.info("stopped before the shards were ready")
            return 0
        stop_task.cancel()
        connection = connect_task.result()
        client, warm, shard, limits = (
            connection.client,
            connection.warmup,
            connection.shard,
            connection.limits,
        )
        tokenizer = TokenizerPool(_tokenizer_path(args, shard.model_id), args.validation_workers)
        engine = source.build_engine(
            connection,
            engine_config(args, limits),
            lambda reason: health_reporter.shard_failed(),
        )
        holder["engine"] = engine
        await engine.start()
        validation_limits = ValidationLimits(
            max_input_tokens=limits.max_input_tokens,
            max_total_tokens=limits.max_total_tokens,
            max_best_of=args.max_best_of,
            max_stop_sequences=args.max_stop_sequences,
            max_top_n_tokens=args.max_top_n_tokens,
            max_client_batch_size=args.max_client_batch_size,
        )
        service = GenerationService(
            engine,
            Validator(validation_limits, tokenizer),
            metrics,
            max_concurrent_requests=args.max_concurrent_requests,
            on_shard_failure=health_reporter.shard_failed,
            admission=admission,
        )
        info = ServerInfo(
            model_id=args.model_id or shard.model_id,
            model_sha=shard.model_sha,
            model_dtype=shard.dtype,
            model_device_type=shard.device_type,
            model_pipeline_tag="text-generation",
            max_concurrent_requests=args.max_concurrent_requests,
            max_best_of=args.max_best_of,
            max_stop_sequences=args.max_stop_sequences,
            max_input_tokens=limits.max_input_tokens,
            max_total_tokens=limits.max_total_tokens,
            validation_workers=args.validation_workers,
            max_client_batch_size=args.max_client_batch_size,
            version=_version(),
            max_top_n_tokens=args.max_top_n_tokens,
            max_batch_total_tokens=warm.max_supported_total_tokens,
            block_size=warm.block_size,
            num_kv_blocks=warm.num_blocks,
            num_shard=shard.world_size,
        )
        servicer.attach(service, info)
        await health_reporter.set_ready()
        _log.info(
            "serving %s: %d KV blocks of %d tokens, max_input_tokens=%d max_total_tokens=%d",
            info.model_id, warm.num_blocks, warm.block_size, limits.max_input_tokens,
            limits.max_total_tokens,
        )  # fmt: skip
        watch = asyncio.ensure_future(watch_shards(client, engine, health_reporter, stop))
        await stop.wait()
        watch.cancel()
        _log.info("draining (up to %.1f s)", args.graceful_timeout)
        await health_reporter.set_not_serving("draining")
        service.start_draining()
        await _drain(engine, service, args.graceful_timeout)
        return 0
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - log and exit non-zero, whatever broke
        _log.exception("router failed")
        await health_reporter.set_not_serving("startup failure")
        return 1
    finally:
        await server.stop(grace=1.0)
        if engine is not None:
            await engine.close()
        if client is not None:
            await client.close()
        if tokenizer is not None:
            tokenizer.close()
        if metrics_server is not None:
            metrics_server.close()


async def _connect(args: argparse.Namespace, target: str) -> Any:
    """Connects to the shards and warms them up; returns (client, warmup, shard info, limits)."""
    from service.shard_client import ShardClient, connect_and_warmup
    from service.shard_convert import WarmupBudgets, shard_info

    # Info first (max_position_embeddings decides the default limits), then warm up.
    probe = ShardClient([target])
    try:
        shard = shard_info(await _retry_info(probe, args.startup_timeout))
    finally:
        await probe.close()
    limits = resolve_limits(args, shard.max_position_embeddings)
    budgets = WarmupBudgets(
        max_input_tokens=limits.max_input_tokens,
        max_total_tokens=limits.max_total_tokens,
        max_batch_prefill_tokens=limits.max_batch_prefill_tokens,
        max_batch_size=limits.max_batch_size,
        max_batch_total_tokens=args.max_batch_total_tokens,
    )
    client, warm, shard = await connect_and_warmup(
        target, budgets, connect_timeout_s=args.startup_timeout
    )
    return client, warm, shard, limits


async def _retry_info(client: Any, timeout_s: float) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            return await client.info()
        except aio.AioRpcError:
            if loop.time() >= deadline:
                raise
            await asyncio.sleep(0.2)


async def watch_shards(client: Any, engine: Any, health_reporter: Any, stop: asyncio.Event) -> None:
    """Flips health to NOT_SERVING when a shard dies while the engine is idle (a busy engine
    finds out from its step RPCs). Only a refused or broken connection counts as death: a slow
    answer from a busy shard does not."""
    while not stop.is_set() and health_reporter.serving:
        await asyncio.sleep(0.5)
        stats = engine.stats()
        if stats.queued or stats.running:
            continue
        try:
            await asyncio.wait_for(client.health(), timeout=10.0)
        except aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                _log.error("shard health check failed: %s", err.details())
                health_reporter.shard_failed()
                return
        except TimeoutError:
            continue


async def _drain(engine: Any, service: Any, timeout_s: float) -> None:
    if not await engine.drain(timeout_s):
        _log.warning("graceful timeout: unfinished requests failed with UNAVAILABLE")
    # Let the servicer send the final events of requests that just finished.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2.0
    while service.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.02)


def _no_stats() -> Any:
    from service.engine_api import EngineStats

    return EngineStats()


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("tokenwire")
    except Exception:  # noqa: BLE001 - not installed (source checkout)
        return "0.0.0"


def run(args: argparse.Namespace) -> int:
    if args.frontends < 1:
        raise SystemExit(f"--frontends must be >= 1 (got {args.frontends})")
    if args.frontend_backlog_steps <= 0:
        raise SystemExit(
            f"--frontend-backlog-steps must be > 0 (got {args.frontend_backlog_steps})"
        )
    if args.frontends > 1:
        from service.frontend import run_multiprocess

        return run_multiprocess(args)
    from service.logs import setup_logging

    setup_logging(json_output=args.json_output, level=args.log_level)
    try:
        return asyncio.run(serve(args))
    except KeyboardInterrupt:
        return 130
