"""OpenTelemetry spans of the shard's steps, in the traces of the requests they serve.

A request traced by the router carries its span's W3C traceparent in `Request.traceparent`.
The shard keeps it while the request is in its batch, and after each Prefill or Decode step
records one span named after the step under each traced request that took part, with the batch
size, the request's id and, for prefill, its chunk. Requests that carry none cost nothing; with
tracing off (no --otlp-endpoint) no StepTracer exists. Only rank 0 records (every rank runs the
same steps).
"""

from __future__ import annotations

from typing import Any

from tokenwire.shard.v1 import shard_pb2 as pb

DEFAULT_OTLP_PORT = 4317


def _endpoint(value: str) -> str:
    rest = value.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return f"http://{rest}:{DEFAULT_OTLP_PORT}"
    return f"http://{host}:{port}"


def _parent(traceparent: str) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


class StepTracer:
    """Records step spans under the traced requests of each step."""

    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("tokenwire.shard")
        self._parents: dict[int, Any] = {}  # request id -> parent context

    @property
    def tracked(self) -> int:
        return len(self._parents)

    def _record(self, name: str, ids: list[int], start_ns: int, end_ns: int,
                chunks: dict[int, int]) -> None:  # fmt: skip
        batch_size = len(ids)
        for rid in ids:
            parent = self._parents.get(rid)
            if parent is None:
                continue
            attributes = {"tokenwire.batch_size": batch_size, "tokenwire.shard_request_id": rid}
            if rid in chunks:
                attributes["tokenwire.chunk_tokens"] = chunks[rid]
            span = self.tracer.start_span(
                name, context=parent, start_time=start_ns, attributes=attributes
            )
            span.end(end_time=end_ns)

    def _keep(self, reply: pb.PrefillResponse | pb.DecodeResponse) -> None:
        """Forgets requests that finished or left the batch."""
        alive = set(reply.batch.request_ids) if reply.HasField("batch") else set()
        for rid in [r for r in self._parents if r not in alive]:
            del self._parents[rid]

    def prefill(
        self, request: pb.PrefillRequest, reply: pb.PrefillResponse, start_ns: int, end_ns: int
    ) -> None:
        chunks = {}
        for r in request.batch.requests:
            if r.traceparent:
                self._parents[r.id] = _parent(r.traceparent)
            chunks[r.id] = r.chunk_len
        if self._parents:
            ids = [r.id for r in request.batch.requests]
            if request.HasField("cached_batch"):
                ids += list(request.cached_batch.request_ids)
            self._record("Prefill", ids, start_ns, end_ns, chunks)
            self._keep(reply)

    def decode(
        self, request: pb.DecodeRequest, reply: pb.DecodeResponse, start_ns: int, end_ns: int
    ) -> None:
        if self._parents:
            ids = [rid for b in request.batches for rid in b.request_ids]
            self._record("Decode", ids, start_ns, end_ns, {})
            self._keep(reply)

    def filter(self, request_ids: list[int]) -> None:
        keep = set(request_ids)
        for rid in [r for r in self._parents if r not in keep]:
            del self._parents[rid]

    def clear(self) -> None:
        self._parents.clear()

    def shutdown(self) -> None:
        self.provider.shutdown()


def setup_step_tracer(endpoint: str | None, service_name: str) -> StepTracer | None:
    """The shard's tracer, or None when `endpoint` is unset (tracing off)."""
    if not endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    exporter = OTLPSpanExporter(endpoint=_endpoint(endpoint), insecure=True)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    return StepTracer(provider)
