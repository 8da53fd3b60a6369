"""The public gRPC servicer (`tokenwire.v1.TextGeneration`) and the standard health reporting.

Thin by design: decode the proto (service.api.convert), call the domain (service.generation.service), encode
the reply. Errors propagate to service.api.interceptors.ErrorInterceptor, which maps them; the one
exception is a stream that already sent events, which also reports its failure in band.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from google.api.httpbody_pb2 import HttpBody
from google.protobuf import json_format
from grpc import aio
from grpc_health.v1 import health, health_pb2
from tokenwire.v1 import generate_pb2 as pb
from tokenwire.v1 import generate_pb2_grpc

from service.api import convert
from service.api.interceptors import current_request_id
from service.api.status import classify, public_message
from service.engine.contracts import DrainingError, ShardUnavailableError
from service.generation.errors import ValidationError
from service.generation.service import GenerationService, ServerInfo
from service.generation.tokenization import Tokenizing
from service.observability.metrics import ServerMetrics

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name
_log = logging.getLogger("tokenwire.router")


class HealthReporter:
    """Whether the router can generate, published through `grpc.health.v1.Health` (for the
    whole server "" and for TextGeneration), the public Health RPC and a metric.

    NOT_SERVING until `set_ready()` (shards warmed up), and again once draining or after a
    shard failure (which is final: the launcher restarts the deployment)."""

    def __init__(self, metrics: ServerMetrics | None = None) -> None:
        self.servicer = health.aio.HealthServicer()
        self._metrics = metrics
        self._ready = False
        self._reason = "warming up"
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def serving(self) -> bool:
        return self._ready

    @property
    def reason(self) -> str:
        """Why the server is not serving ("" when it is)."""
        return "" if self._ready else self._reason

    async def _publish(self) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self._ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            await self.servicer.set(service, status)
        if self._metrics is not None:
            self._metrics.serving.set(1.0 if self._ready else 0.0)

    async def start(self) -> None:
        """Publishes the initial NOT_SERVING."""
        await self._publish()

    async def set_ready(self) -> None:
        if self._reason == "warming up":
            self._ready, self._reason = True, ""
            await self._publish()

    async def set_not_serving(self, reason: str) -> None:
        if self._ready or self._reason != reason:
            _log.warning("health: NOT_SERVING (%s)", reason)
        self._ready, self._reason = False, reason
        await self._publish()

    def shard_failed(self) -> None:
        """Synchronous hook for the domain: a shard failed."""
        if self._reason == "shard failure":
            return
        self._ready, self._reason = False, "shard failure"
        task = asyncio.get_running_loop().create_task(self.set_not_serving("shard failure"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class TextGenerationServicer(generate_pb2_grpc.TextGenerationServicer):
    """tokenwire.v1.TextGeneration over a GenerationService."""

    def __init__(
        self,
        service: GenerationService | None,
        health_reporter: HealthReporter,
        info: ServerInfo | None = None,
    ) -> None:
        self._service_or_none = service
        self._info_or_none = info
        self._health = health_reporter
        self._tokenizer: Tokenizing | None = None

    def attach(
        self, service: GenerationService, info: ServerInfo, tokenizer: Tokenizing | None = None
    ) -> None:
        """Starts generating (the servicer is registered before the shards are warm);
        `tokenizer` serves Tokenize."""
        self._service_or_none, self._info_or_none = service, info
        self._tokenizer = tokenizer

    @property
    def _service(self) -> GenerationService:
        if self._service_or_none is None:
            raise ShardUnavailableError(f"not serving yet: {self._health.reason or 'starting'}")
        return self._service_or_none

    # What the REST face (service.api.tgi_servicer) shares with the typed RPCs.
    @property
    def generation(self) -> GenerationService:
        """The domain object; ShardUnavailableError until attached."""
        return self._service

    @property
    def health(self) -> HealthReporter:
        return self._health

    @property
    def server_info_or_none(self) -> ServerInfo | None:
        return self._info_or_none

    def server_info(self) -> ServerInfo:
        return self._info()

    @property
    def tokenizer(self) -> Tokenizing:
        if self._tokenizer is None:
            raise ShardUnavailableError(f"not serving yet: {self._health.reason or 'starting'}")
        return self._tokenizer

    def _info(self) -> ServerInfo:
        if self._info_or_none is None:
            raise ShardUnavailableError(f"not serving yet: {self._health.reason or 'starting'}")
        return self._info_or_none

    async def Generate(
        self, request: pb.GenerateRequest, context: aio.ServicerContext
    ) -> pb.GenerateResponse:
        outcome = await self._service.generate(
            convert.generate_input(request),
            request_id=current_request_id(),
            deadline=convert.deadline(context.time_remaining()),
        )
        return convert.generate_response(outcome)

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        items = self._service.stream(
            convert.generate_input(request),
            request_id=current_request_id(),
            deadline=convert.deadline(context.time_remaining()),
        )
        sent = 0  # tokens sent: the in-band error event's index
        encode = convert.stream_response
        coalesce = request.parameters.coalesce_tokens
        async with aclosing(items):
            try:
                async for item in items:
                    if coalesce:
                        # Tokens that queued up while the client read: one event for them all.
                        batch = [item]
                        while item.backlog and item.finished is None:
                            item = await anext(items)
                            batch.append(item)
                        yield convert.stream_response_coalesced(batch)
                        sent += len(batch)
                        continue
                    yield encode(item)
                    sent += 1
            except Exception as error:
                if sent:
                    # HTTP/1.1 SSE clients behind Envoy never see trailers: say it in band too.
                    yield convert.stream_error(sent, classify(error), public_message(error))
                raise

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: aio.ServicerContext
    ) -> pb.TokenizeResponse:
        if self._tokenizer is None:
            raise ShardUnavailableError(f"not serving yet: {self._health.reason or 'starting'}")
        if not request.inputs:
            raise ValidationError("inputs", "inputs must not be empty")
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        tokens = await self._tokenizer.tokenize(request.inputs, add_special)
        return pb.TokenizeResponse(
            tokens=[
                pb.SimpleToken(id=i, text=text, start=start, stop=stop)
                for i, text, start, stop in tokens
            ]
        )

    async def TokenizeHttp(self, request: HttpBody, context: aio.ServicerContext) -> HttpBody:
        try:
            parsed = json_format.Parse(
                request.data or b"{}", pb.TokenizeRequest(), ignore_unknown_fields=True
            )
        except json_format.ParseError as error:
            raise ValidationError("body", f"the request body is not a TokenizeRequest: {error}")
        reply = await self.Tokenize(parsed, context)
        # TGI's array of {id, text, start, stop}, in that order.
        tokens = [
            {"id": t.id, "text": t.text, "start": t.start, "stop": t.stop} for t in reply.tokens
        ]
        return HttpBody(content_type="application/json", data=json.dumps(tokens).encode())

    async def Info(self, request: pb.InfoRequest, context: aio.ServicerContext) -> pb.InfoResponse:
        return convert.info_response(self._info(), self._service.adapters())

    async def LoadAdapter(
        self, request: pb.LoadAdapterRequest, context: aio.ServicerContext
    ) -> pb.LoadAdapterResponse:
        loaded = await self._service.load_adapters(convert.adapter_sources(request))
        return pb.LoadAdapterResponse(adapters=[convert.adapter(a) for a in loaded])

    async def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: aio.ServicerContext
    ) -> pb.UnloadAdapterResponse:
        await self._service.unload_adapter(request.name)
        return pb.UnloadAdapterResponse()

    async def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: aio.ServicerContext
    ) -> pb.ListAdaptersResponse:
        return pb.ListAdaptersResponse(
            adapters=[convert.adapter(a) for a in self._service.adapters()]
        )

    async def Health(
        self, request: pb.HealthRequest, context: aio.ServicerContext
    ) -> pb.HealthResponse:
        if not self._health.serving:
            reason = self._health.reason
            if reason == "draining":
                raise DrainingError("the server is draining")
            raise ShardUnavailableError(f"not serving: {reason}")
        return pb.HealthResponse()
