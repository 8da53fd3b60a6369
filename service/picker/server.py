"""The endpoint picker as a gRPC server: Envoy's ext_proc protocol as GIE's endpoint-picker
protocol uses it, plus grpc.health.v1.

Per request (one ext_proc stream): the request headers give the path; the first request body
message gives the prompt (the body is buffered by Envoy; a streamed body's first chunk holds the
start of the prompt, which is all the prefix index needs). The answer sets
`x-gateway-destination-endpoint` to the ranked replicas, `ip:port` comma-separated (first the
destination, then the fallbacks Envoy's retries walk), and the same value under dynamic
metadata `envoy.lb` (GIE asks for both). A request without a body is placed at its headers.
GIE's subset hint (`envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset` in the
request's metadata) restricts the choice; no ready replica in the subset: an immediate 503 (gRPC
UNAVAILABLE), as GIE asks. With no subset and no replica ready by its metrics, the picker names
none and Envoy's own balancing and health checks decide (the metrics may only be late: a
scrape can miss a busy replica). Every other step is answered with "continue unchanged".
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from google.protobuf import struct_pb2
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tokenwire.third_party import ext_proc_pb2 as xp
from tokenwire.third_party import ext_proc_pb2_grpc as xp_grpc

from service.picker.picker import EndpointPicker
from service.picker.prompt import prompt_text

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
_GRPC_UNAVAILABLE = 14
_log = logging.getLogger("tokenwire.picker")


def header_value(headers: xp.HeaderMap, name: str) -> str:
    for h in headers.headers:
        if h.key == name:
            return h.raw_value.decode("latin-1") if h.raw_value else h.value
    return ""


def subset_hint(request: xp.ProcessingRequest) -> set[str] | None:
    meta = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in meta:
        return None
    fields = meta[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    return {v.string_value for v in fields[SUBSET_KEY].list_value.values}


def destination(endpoints: list[str]) -> tuple[xp.CommonResponse, struct_pb2.Struct]:
    """The header mutation and dynamic metadata naming `endpoints`."""
    value = ",".join(endpoints)
    common = xp.CommonResponse(
        header_mutation=xp.HeaderMutation(
            set_headers=[
                xp.HeaderValueOption(
                    header=xp.HeaderValue(key=DESTINATION_HEADER, raw_value=value.encode()),
                    append_action=xp.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                )
            ]
        )
    )
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct(LB_NAMESPACE)[DESTINATION_HEADER] = value
    return common, metadata


def no_endpoint() -> xp.ProcessingResponse:
    return xp.ProcessingResponse(
        immediate_response=xp.ImmediateResponse(
            status=xp.HttpStatus(code=503),
            body=b"no ready replica",
            grpc_status=xp.GrpcStatus(status=_GRPC_UNAVAILABLE),
            details="tokenwire_picker_no_ready_replica",
        )
    )


class ExternalProcessorServicer(xp_grpc.ExternalProcessorServicer):
    """envoy.service.ext_proc.v3.ExternalProcessor over an EndpointPicker."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker

    def _decide(
        self, path: str, body: bytes, subset: set[str] | None, step: str
    ) -> xp.ProcessingResponse:
        endpoints = self.picker.pick(prompt_text(path, body), subset)
        if not endpoints:
            if subset is not None:
                return no_endpoint()
            if step == "request_headers":
                return xp.ProcessingResponse(request_headers=xp.HeadersResponse())
            return xp.ProcessingResponse(request_body=xp.BodyResponse())
        common, metadata = destination(endpoints)
        _log.debug("%s -> %s", path, endpoints[0])
        if step == "request_headers":
            return xp.ProcessingResponse(
                request_headers=xp.HeadersResponse(response=common), dynamic_metadata=metadata
            )
        return xp.ProcessingResponse(
            request_body=xp.BodyResponse(response=common), dynamic_metadata=metadata
        )

    async def Process(
        self, request_iterator: AsyncIterator[xp.ProcessingRequest], context: aio.ServicerContext
    ) -> AsyncIterator[xp.ProcessingResponse]:
        path = ""
        subset: set[str] | None = None
        picked = False
        async for request in request_iterator:
            step = request.WhichOneof("request")
            if request.observability_mode:
                continue
            if step == "request_headers":
                path = header_value(request.request_headers.headers, ":path")
                subset = subset_hint(request)
                if request.request_headers.end_of_stream:
                    picked = True
                    yield self._decide(path, b"", subset, step)
                else:
                    yield xp.ProcessingResponse(request_headers=xp.HeadersResponse())
            elif step == "request_body":
                if not picked:
                    picked = True
                    yield self._decide(path, request.request_body.body, subset, step)
                else:
                    yield xp.ProcessingResponse(request_body=xp.BodyResponse())
            elif step == "response_headers":
                yield xp.ProcessingResponse(response_headers=xp.HeadersResponse())
            elif step == "response_body":
                yield xp.ProcessingResponse(response_body=xp.BodyResponse())
            elif step == "request_trailers":
                yield xp.ProcessingResponse(request_trailers=xp.TrailersResponse())
            elif step == "response_trailers":
                yield xp.ProcessingResponse(response_trailers=xp.TrailersResponse())


async def start_server(
    picker: EndpointPicker, host: str, port: int
) -> tuple[aio.Server, int, health.aio.HealthServicer]:
    """Starts the picker's gRPC server (ext_proc + health, NOT_SERVING until `set_ready`)."""
    server = aio.server()
    xp_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessorServicer(picker), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"picker cannot listen on {host}:{port}")
    await server.start()
    for name in HEALTH_SERVICES:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if name == "liveness"
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await health_servicer.set(name, status)
    return server, bound, health_servicer


async def set_ready(health_servicer: health.aio.HealthServicer) -> None:
    for name in HEALTH_SERVICES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


__all__ = ["ExternalProcessorServicer", "set_ready", "start_server"]
