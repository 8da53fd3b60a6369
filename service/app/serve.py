"""The router process: serve the public API over an engine, health-check the shards, drain.

Startup: serve `grpc.health.v1.Health` (NOT_SERVING) and reflection at once, connect to the
shards through the `EngineSource` (Info, Warmup), build the engine, then serve
`tokenwire.v1.TextGeneration` (SERVING). SIGTERM/SIGINT (or `stop`): refuse new requests,
NOT_SERVING, drain up to --graceful-timeout, stay up until --shutdown-delay has passed (health
checkers see NOT_SERVING, not a closed port), stop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, generate_latest

from service.api.anthropic_servicer import AnthropicServicer
from service.api.openai_servicer import OpenAIServicer
from service.api.responses_servicer import ResponsesServicer
from service.api.server import build_server
from service.api.servicer import HealthReporter, TextGenerationServicer
from service.api.tgi_servicer import TgiHttpOptions, TgiHttpServicer
from service.app.engine_source import EngineSource, ShardEngineSource, ShardLink
from service.app.router_flags import (
    FlagError,
    engine_config,
    image_limits,
    validation_limits,
)
from service.engine.backend import ShardRpcError
from service.engine.contracts import Engine, EngineStats
from service.generation.chat_template import ChatTemplate
from service.generation.grammar import GrammarCompiler
from service.generation.images.pipeline import ImagePipeline
from service.generation.openai import OpenAIEndpoints, OutputParsers
from service.generation.parsers.registry import (
    reasoning_parser,
    special_token_ids,
    tool_call_parser,
)
from service.generation.response_store import ResponseStore
from service.generation.responses import ResponsesEndpoints
from service.generation.service import Admission, GenerationService, ServerInfo
from service.generation.text_stream import RouterText
from service.generation.tokenization import TokenizerPool
from service.generation.validation import Validator
from service.observability.metrics import MetricsServer, ServerMetrics
from service.observability.tracing import setup_tracing

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_log = logging.getLogger("tokenwire.router")
_METRICS_FETCH_TIMEOUT_S = 2.0


class ShardHealthReporter(Protocol):
    """What watch_shards reports to (the router's HealthReporter, or the scheduler process's)."""

    @property
    def serving(self) -> bool: ...

    def shard_failed(self) -> None: ...


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

    `engine_source`: where the engine comes from (default `ShardEngineSource(args)`, with the
    process's full garbage collections paced by the engine);
    `reuse_port`: share the port with other processes (SO_REUSEPORT); `admission`: a counter of
    client requests in flight shared with other processes, checked beside the local limit."""
    stop = stop or asyncio.Event()
    source = engine_source if engine_source is not None else ShardEngineSource(args, pace_gc=True)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass

    # Serve health (NOT_SERVING) and reflection while the shards warm up, so probes get answers.
    holder: dict[str, Engine] = {}
    metrics = ServerMetrics(
        stats=lambda: holder["engine"].stats() if "engine" in holder else EngineStats()
    )
    health_reporter = HealthReporter(metrics)
    await health_reporter.start()
    tracing = setup_tracing(args.otlp_endpoint, f"{args.otlp_service_name}.router")
    servicer = TextGenerationServicer(None, health_reporter)
    openai_servicer = OpenAIServicer()
    tgi_servicer = TgiHttpServicer(
        servicer,
        openai_servicer,
        TgiHttpOptions(
            # A front end of --frontends N serves the scheduler process's merged metrics.
            metrics_text=_metrics_text(getattr(args, "merged_metrics_url", None), metrics.registry),
        ),
    )
    responses_servicer = ResponsesServicer()
    anthropic_servicer = AnthropicServicer()
    server, port = build_server(
        servicer,
        health_reporter,
        host=args.hostname,
        port=args.port,
        api_key=args.api_key,
        reuse_port=reuse_port,
        openai=openai_servicer,
        responses=responses_servicer,
        anthropic=anthropic_servicer,
        tracing=tracing,
        tgi=tgi_servicer,
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
    chat_template = None
    grammars = None
    images: ImagePipeline | None = None
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
        tokenizer_path = _tokenizer_path(args, shard.model_id)
        tokenizer = TokenizerPool(tokenizer_path, args.validation_workers)
        chat_template = ChatTemplate(
            tokenizer_path if tokenizer_path.is_dir() else tokenizer_path.parent,
            args.chat_template,
        )
        grammars = GrammarCompiler(
            tokenizer_path,
            shard.vocab_size,
            min(shard.eos_token_ids) if shard.eos_token_ids else None,
        )
        engine = source.build_engine(
            connection,
            engine_config(args, limits),
            lambda reason: health_reporter.shard_failed(),
            metrics.forget_adapter,
        )
        holder["engine"] = engine
        metrics.adapter_load.max_lora = shard.max_loras
        await engine.start()
        model_dir = tokenizer_path if tokenizer_path.is_dir() else tokenizer_path.parent
        # None for a text model; off the event loop: loading imports transformers.
        images = await asyncio.to_thread(ImagePipeline.load, model_dir, image_limits(args))
        service = GenerationService(
            engine,
            Validator(validation_limits(args, limits), tokenizer, grammars, images),
            metrics,
            max_concurrent_requests=args.max_concurrent_requests,
            on_shard_failure=health_reporter.shard_failed,
            admission=admission,
            tracing=tracing,
            text=RouterText(tokenizer.tokenizer) if args.router_detokenize else None,
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
            max_loras=shard.max_loras,
            max_lora_rank=shard.max_lora_rank,
            speculate=args.speculate,
            max_batch_size=limits.max_batch_size,
            waiting_served_ratio=args.waiting_served_ratio,
            max_waiting_tokens=args.max_waiting_tokens,
            model_impl=shard.model_impl,
            cuda_graphs=shard.cuda_graphs,
        )
        servicer.attach(service, info, tokenizer)
        chat_endpoints = OpenAIEndpoints(
            service,
            model_id=info.model_id,
            system_fingerprint=f"tokenwire-{info.version}",
            chat_template=chat_template,
            parsers=output_parsers(args, chat_template, tokenizer.tokenizer),
        )
        openai_servicer.attach(chat_endpoints)
        anthropic_servicer.attach(chat_endpoints)
        store = ResponseStore(
            args.responses_store_size,
            args.responses_store_ttl,
            on_evict=metrics.observe_response_eviction,
        )
        metrics.responses_stored.set_function(lambda: len(store))
        responses_servicer.attach(ResponsesEndpoints(chat_endpoints, store))
        await grammars.ready()
        await health_reporter.set_ready()
        _log.info(
            "serving %s: %d KV blocks of %d tokens, max_input_tokens=%d max_total_tokens=%d",
            info.model_id, warm.num_blocks, warm.block_size, limits.max_input_tokens,
            limits.max_total_tokens,
        )  # fmt: skip
        watch = asyncio.ensure_future(watch_shards(client, engine, health_reporter, stop))
        await stop.wait()
        stopped_at = loop.time()
        watch.cancel()
        _log.info("draining (up to %.1f s)", args.graceful_timeout)
        # Refuse first, then say so: a client that sees NOT_SERVING is never admitted after.
        service.start_draining()
        await health_reporter.set_not_serving("draining")
        await _drain(engine, service, args.graceful_timeout)
        delay = min(args.shutdown_delay, args.graceful_timeout) - (loop.time() - stopped_at)
        if delay > 0:
            _log.info("drained; answering NOT_SERVING for %.1f s more (--shutdown-delay)", delay)
            await asyncio.sleep(delay)
        return 0
    except (asyncio.CancelledError, FlagError):
        raise  # a flag the model cannot serve: the entry point says so in one line
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
        if chat_template is not None:
            chat_template.close()
        if grammars is not None:
            grammars.close()
        if images is not None:
            images.close()
        if metrics_server is not None:
            metrics_server.close()
        if tracing is not None:
            tracing.shutdown()


async def watch_shards(
    client: ShardLink, engine: Engine, health_reporter: ShardHealthReporter, stop: asyncio.Event
) -> None:
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
        except ShardRpcError as err:
            if err.unreachable:
                _log.error("shard health check failed: %s", err.details)
                health_reporter.shard_failed()
                return
        except TimeoutError:
            continue


async def _drain(engine: Engine, service: GenerationService, timeout_s: float) -> None:
    if not await engine.drain(timeout_s):
        _log.warning("graceful timeout: unfinished requests failed with UNAVAILABLE")
    # Let the servicer send the final events of requests that just finished.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2.0
    while service.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.02)


def _metrics_text(
    merged_url: str | None, registry: CollectorRegistry
) -> Callable[[], Awaitable[bytes]]:
    """GET /metrics through Envoy (TGI serves it on its HTTP port): this process's Prometheus
    text, or, in a front end of `--frontends N`, the scheduler process's merged text (every front
    end's requests and the engine), read from `merged_url` (its --prometheus-port)."""

    def fetch(url: str) -> bytes:
        with urllib.request.urlopen(url, timeout=_METRICS_FETCH_TIMEOUT_S) as reply:
            data: bytes = reply.read()
            return data

    async def render() -> bytes:
        if merged_url is not None:
            try:
                return await asyncio.to_thread(fetch, merged_url)
            except OSError as error:
                _log.warning("merged metrics unavailable (%s); serving this process's", error)
        return generate_latest(registry)

    return render


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("tokenwire")
    except Exception:  # noqa: BLE001 - not installed (source checkout)
        return "0.0.0"


def _tokenizer_path(args: argparse.Namespace, shard_model_id: str) -> Path:
    if args.tokenizer is not None:
        return Path(args.tokenizer)
    from shard.tools.download import resolve_model

    return resolve_model(args.model_id or shard_model_id)


def output_parsers(
    args: argparse.Namespace, chat_template: ChatTemplate, tokenizer: Tokenizer
) -> OutputParsers:
    """The reasoning and tool-call parsers of --reasoning-parser / --tool-call-parser ("auto"
    reads the chat template)."""
    tools = tool_call_parser(args.tool_call_parser, chat_template.source())
    _log.info("reasoning parser %s, tool-call parser %s", args.reasoning_parser, tools.name)
    return OutputParsers(reasoning_parser(args.reasoning_parser), tools,
                         special_token_ids(tokenizer))  # fmt: skip
