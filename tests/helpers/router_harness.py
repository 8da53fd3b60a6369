"""An in-process public router (real servicer, interceptors, validation, tokenizer, metrics,
health, reflection) over grpc.aio loopback, in front of any Engine (usually the double)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc import aio
from tokenwire.v1 import generate_pb2_grpc

from service.api.server import build_server
from service.api.servicer import HealthReporter, TextGenerationServicer
from service.engine.contracts import Engine
from service.generation.service import GenerationService, ServerInfo
from service.generation.tokenization import TokenizerPool
from service.generation.validation import ValidationLimits, Validator
from service.observability.metrics import ServerMetrics

DEFAULT_LIMITS = ValidationLimits(
    max_input_tokens=64,
    max_total_tokens=96,
    max_best_of=2,
    max_stop_sequences=4,
    max_top_n_tokens=5,
    max_client_batch_size=4,
)


def server_info(limits: ValidationLimits, max_concurrent_requests: int) -> ServerInfo:
    return ServerInfo(
        model_id="tiny-test",
        model_sha=None,
        model_dtype="float32",
        model_device_type="cpu",
        model_pipeline_tag="text-generation",
        max_concurrent_requests=max_concurrent_requests,
        max_best_of=limits.max_best_of,
        max_stop_sequences=limits.max_stop_sequences,
        max_input_tokens=limits.max_input_tokens,
        max_total_tokens=limits.max_total_tokens,
        validation_workers=1,
        max_client_batch_size=limits.max_client_batch_size,
        version="test",
        max_top_n_tokens=limits.max_top_n_tokens,
        max_batch_total_tokens=1024,
        block_size=16,
        num_kv_blocks=64,
        num_shard=1,
    )


@dataclass
class Router:
    server: aio.Server
    port: int
    channel: aio.Channel
    stub: generate_pb2_grpc.TextGenerationStub
    engine: Engine
    service: GenerationService
    metrics: ServerMetrics
    health: HealthReporter
    servicer: TextGenerationServicer

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@asynccontextmanager
async def running_router(
    engine: Engine,
    tokenizer_dir: Path,
    *,
    limits: ValidationLimits = DEFAULT_LIMITS,
    max_concurrent_requests: int = 16,
    api_key: str | None = None,
    ready: bool = True,
) -> AsyncIterator[Router]:
    """Starts the router on a free loopback port; stops it on exit."""
    tokenizer = TokenizerPool(tokenizer_dir, workers=1)
    metrics = ServerMetrics(stats=engine.stats)
    health = HealthReporter(metrics)
    await health.start()
    service = GenerationService(
        engine,
        Validator(limits, tokenizer),
        metrics,
        max_concurrent_requests=max_concurrent_requests,
        on_shard_failure=health.shard_failed,
    )
    servicer = TextGenerationServicer(None, health)
    server, port = build_server(servicer, health, host="127.0.0.1", port=0, api_key=api_key)
    await server.start()
    if ready:
        servicer.attach(service, server_info(limits, max_concurrent_requests))
        await health.set_ready()
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Router(
            server=server,
            port=port,
            channel=channel,
            stub=generate_pb2_grpc.TextGenerationStub(channel),
            engine=engine,
            service=service,
            metrics=metrics,
            health=health,
            servicer=servicer,
        )
    finally:
        await channel.close()
        await server.stop(grace=None)
        tokenizer.close()


async def rpc_error(call: object) -> grpc.aio.AioRpcError:
    """Awaits a unary call (or drains a stream) and returns the error it must end with."""
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:  # type: ignore[attr-defined]
                pass
        else:
            await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as err:
        return err
    raise AssertionError("the call succeeded but an error was expected")
