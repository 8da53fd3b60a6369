"""The public gRPC server: TextGeneration, grpc.health.v1 and reflection behind the interceptors."""

from __future__ import annotations

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tokenwire.v1 import (
    anthropic_pb2,
    anthropic_pb2_grpc,
    generate_pb2_grpc,
    openai_pb2,
    openai_pb2_grpc,
    responses_pb2,
    responses_pb2_grpc,
)

from service.api.anthropic_servicer import AnthropicServicer
from service.api.interceptors import server_interceptors
from service.api.openai_servicer import OpenAIServicer
from service.api.responses_servicer import ResponsesServicer
from service.api.servicer import SERVICE_NAME, HealthReporter, TextGenerationServicer
from service.observability.tracing import Tracing


def build_server(
    servicer: TextGenerationServicer,
    health_reporter: HealthReporter,
    *,
    host: str,
    port: int,
    api_key: str | None,
    reuse_port: bool = False,
    openai: OpenAIServicer | None = None,
    responses: ResponsesServicer | None = None,
    anthropic: AnthropicServicer | None = None,
    tracing: Tracing | None = None,
) -> tuple[aio.Server, int]:
    """The public gRPC server (not started): TextGeneration, grpc.health.v1 and reflection of
    every service, behind the interceptors (and tokenwire.v1.OpenAIService, ResponsesService,
    AnthropicService when `openai`, `responses`, `anthropic` are given). Returns it with its bound port. `reuse_port`:
    several processes listen on the port (SO_REUSEPORT) and the kernel spreads connections.
    `tracing`: OpenTelemetry's server interceptor outermost (it continues the caller's
    traceparent in a server span; health checks are not traced)."""
    interceptors = server_interceptors(api_key)
    if tracing is not None:
        from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

        interceptors.insert(
            0,
            aio_server_interceptor(
                tracer_provider=tracing.provider,
                filter_=filters.negate(
                    filters.any_of(filters.health_check(), filters.service_prefix("grpc."))
                ),
            ),
        )
    server = aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.so_reuseport", int(reuse_port)),
            ("grpc.max_receive_message_length", 16 << 20),
            ("grpc.max_send_message_length", 64 << 20),
        ],
    )
    generate_pb2_grpc.add_TextGenerationServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_reporter.servicer, server)
    services: tuple[str, ...] = (
        SERVICE_NAME,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    if openai is not None:
        openai_pb2_grpc.add_OpenAIServiceServicer_to_server(openai, server)
        services += (openai_pb2.DESCRIPTOR.services_by_name["OpenAIService"].full_name,)
    if responses is not None:
        responses_pb2_grpc.add_ResponsesServiceServicer_to_server(responses, server)
        services += (responses_pb2.DESCRIPTOR.services_by_name["ResponsesService"].full_name,)
    if anthropic is not None:
        anthropic_pb2_grpc.add_AnthropicServiceServicer_to_server(anthropic, server)
        services += (anthropic_pb2.DESCRIPTOR.services_by_name["AnthropicService"].full_name,)
    reflection.enable_server_reflection(services, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise SystemExit(f"cannot listen on {host}:{port}")
    return server, bound
