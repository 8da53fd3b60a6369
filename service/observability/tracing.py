"""OpenTelemetry tracing of the router: off unless an OTLP endpoint is given (`--otlp-endpoint`).

On: one TracerProvider per server (never the global one), spans batched and exported over
OTLP/gRPC. The public gRPC server gets OpenTelemetry's gRPC server interceptor (service.api.server),
which continues the caller's W3C `traceparent` (Envoy's span) in a server span. Each client
request then gets a `tokenwire.<method>` span under it, with children `validate`, `queue`,
`prefill`, `decode` and, for streams, `stream`, recorded when the request ends from the times
the service measured anyway (no work per token). The request span's traceparent travels with
the request to the shards (`ValidatedRequest.traceparent`), whose Prefill/Decode step spans
become its children. Only sampled requests carry one.

Off: no provider, no interceptor; the generation service checks one `None` per request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

DEFAULT_OTLP_PORT = 4317


def parse_endpoint(value: str) -> tuple[str, int]:
    """`HOST:PORT`, `http://HOST:PORT` or `HOST` (port 4317) -> (host, port)."""
    rest = value.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or "]" in port:
        return rest.strip("[]"), DEFAULT_OTLP_PORT
    return host.strip("[]"), int(port)


@dataclass
class Tracing:
    """A tracer provider exporting to one OTLP collector."""

    provider: Any  # opentelemetry.sdk.trace.TracerProvider
    tracer: Any  # opentelemetry.trace.Tracer

    def begin(self, method: str, request_id: str) -> RequestTrace:
        return RequestTrace(self.tracer, method, request_id)

    def shutdown(self) -> None:
        """Exports what is buffered and stops the exporter."""
        self.provider.shutdown()


def setup_tracing(endpoint: str | None, service_name: str) -> Tracing | None:
    """The tracing of one process, or None when `endpoint` is unset (tracing off)."""
    if not endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    host, port = parse_endpoint(endpoint)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    exporter = OTLPSpanExporter(endpoint=f"http://{host}:{port}", insecure=True)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    return Tracing(provider, provider.get_tracer("tokenwire"))


def traceparent_of(span: Any) -> str | None:
    """W3C traceparent naming `span` as parent, or None when it is not sampled."""
    ctx = span.get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


class RequestTrace:
    """The spans of one client request in the router. Started in the caller's context (the gRPC
    server span); `finish` records the phases with the times the service measured."""

    __slots__ = ("_tracer", "span", "traceparent")

    def __init__(self, tracer: Any, method: str, request_id: str) -> None:
        self._tracer = tracer
        self.span = tracer.start_span(
            f"tokenwire.{method}",
            attributes={"tokenwire.request_id": request_id, "tokenwire.method": method},
        )
        self.traceparent = traceparent_of(self.span)

    def finish(
        self,
        *,
        start: float,
        validated: float | None,
        queue_seconds: float,
        first_token: float | None,
        last_token: float | None,
        stream: bool,
        attributes: dict[str, Any],
        error: BaseException | None = None,
    ) -> None:
        """Ends the request span after its phase spans. Times are time.monotonic() seconds."""
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        now_mono = time.monotonic()
        offset_ns = time.time_ns() - int(now_mono * 1e9)

        def ns(t: float) -> int:
            return int(t * 1e9) + offset_ns

        parent = trace.set_span_in_context(self.span)
        phases: list[tuple[str, float, float]] = []
        end_validate = validated if validated is not None else now_mono
        phases.append(("validate", start, end_validate))
        if validated is not None:
            scheduled = validated + queue_seconds
            if first_token is not None:
                scheduled = min(scheduled, first_token)
            phases.append(("queue", validated, scheduled if first_token else now_mono))
            if first_token is not None:
                phases.append(("prefill", scheduled, first_token))
                if last_token is not None and last_token > first_token:
                    phases.append(("decode", first_token, last_token))
                if stream:
                    phases.append(("stream", first_token, now_mono))
        for name, begin, end in phases:
            span = self._tracer.start_span(name, context=parent, start_time=ns(begin))
            span.end(end_time=ns(max(begin, end)))
        self.span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if error is not None:
            self.span.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))
        self.span.end(end_time=ns(now_mono))
