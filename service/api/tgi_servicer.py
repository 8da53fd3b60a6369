"""The servicer of `tokenwire.v1.TgiHttpService`: TGI's REST routes behind Envoy, each a thin
HttpBody layer over the same domain objects the typed `TextGeneration` RPCs use.

Every route answers its errors itself, as TGI's `{"error", "error_type"}` body whose HTTP status
goes out in the `x-tokenwire-http-status` response header (Envoy's Lua filter sets the status
from it): a gRPC error would reach HTTP clients in the transcoder's `{"code","message"}` shape.
SSE routes answer 200 and report every failure, also one before the first token, as an in-band
error event, which is what TGI's handler does (its SSE headers go out before generation starts)
and what its clients parse.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from importlib import resources

from google.api.httpbody_pb2 import HttpBody
from grpc import aio
from tokenwire.v1 import tgi_pb2_grpc

from service.api import convert, tgi_json
from service.api.interceptors import current_request_id, set_response_header
from service.api.openai_json import chat_request
from service.api.openai_servicer import HTTP_STATUS_HEADER, OpenAIServicer
from service.api.servicer import TextGenerationServicer
from service.api.status import is_domain_error
from service.engine.contracts import ShardUnavailableError
from service.generation.errors import ValidationError
from service.generation.openai import TGI_MODEL_ALIAS
from service.generation.service import StreamItem

_log = logging.getLogger("tokenwire.router")
OPENAPI_RESOURCE = "openapi.json"


@dataclass(frozen=True)
class TgiHttpOptions:
    """What the REST face needs beyond the domain: the `x-compute-type` header's value (TGI:
    the hardware, e.g. "gpu+optimized"; None: the shards' device type, "cpu" or "cuda") and how
    to render GET /metrics."""

    compute_type: str | None = None
    metrics_text: Callable[[], Awaitable[bytes]] | None = None


def openapi_document() -> bytes:
    """tokenwire's OpenAPI 3.1 description of its REST surface (service/api/openapi.json)."""
    return resources.files("service.api").joinpath(OPENAPI_RESOURCE).read_bytes()


class TgiHttpServicer(tgi_pb2_grpc.TgiHttpServiceServicer):
    """tokenwire.v1.TgiHttpService over the TextGeneration servicer's domain objects and the
    OpenAI servicer (SageMaker's /invocations with chat or completions bodies)."""

    def __init__(
        self,
        text: TextGenerationServicer,
        openai: OpenAIServicer | None = None,
        options: TgiHttpOptions | None = None,
    ) -> None:
        self._text = text
        self._openai = openai
        self._options = options or TgiHttpOptions()

    # --- generation ------------------------------------------------------------------------

    async def Generate(
        self, request: HttpBody, context: aio.ServicerContext
    ) -> AsyncIterator[HttpBody]:
        async for body in _json_route(self._generate(request.data, context, array=False)):
            yield body

    async def CompatGenerate(
        self, request: HttpBody, context: aio.ServicerContext
    ) -> AsyncIterator[HttpBody]:
        async for body in self._compat(request.data, context):
            yield body

    async def GenerateStream(
        self, request: HttpBody, context: aio.ServicerContext
    ) -> AsyncIterator[HttpBody]:
        async for body in self._stream(request.data, context):
            yield body

    async def Invocations(
        self, request: HttpBody, context: aio.ServicerContext
    ) -> AsyncIterator[HttpBody]:
        """SageMaker: the body's keys pick the route (TGI's sagemaker_compatibility)."""
        try:
            body = tgi_json.body_object(request.data)
        except ValidationError as error:
            async for reply in _json_route(_raise(error)):
                yield reply
            return
        chat = body.get("messages") is not None
        if self._openai is not None and (chat or body.get("prompt") is not None):
            body.setdefault("model", TGI_MODEL_ALIAS)  # optional in TGI's ChatRequest
            forwarded = HttpBody(content_type=tgi_json.JSON, data=tgi_json.dumps(body))
            replies = self._openai.with_errors(
                forwarded,
                context,
                chat=chat,
                error_body=tgi_json.error_body,
                error_event=tgi_json.error_event,
            )
            async for reply in replies:
                yield reply
            return
        async for reply in self._compat(request.data, context):
            yield reply

    async def _compat(self, data: bytes, context: aio.ServicerContext) -> AsyncIterator[HttpBody]:
        """POST /: `stream: true` is /generate_stream, otherwise /generate's answer in an array."""
        try:
            body = tgi_json.body_object(data)
            stream = tgi_json.generate_from(body).stream
        except ValidationError as error:
            async for reply in _json_route(_raise(error)):
                yield reply
            return
        if stream:
            async for reply in self._stream(data, context, compat=True):
                yield reply
            return
        async for reply in _json_route(self._generate(data, context, array=True)):
            yield reply

    def _compute_type(self) -> str:
        if self._options.compute_type is not None:
            return self._options.compute_type
        info = self._text.server_info_or_none
        return info.model_device_type if info is not None else "cpu"

    def _full_text_default(self) -> bool:
        info = self._text.server_info_or_none
        return info is not None and info.model_pipeline_tag == "text-generation"

    async def _generate(
        self, data: bytes, context: aio.ServicerContext, *, array: bool
    ) -> AsyncIterator[HttpBody]:
        body = tgi_json.body_object(data)
        request = tgi_json.generate_from(body)
        if array:
            request = tgi_json.with_default_full_text(request, body, self._full_text_default())
        outcome = await self._text.generation.generate(
            request.input,
            request_id=current_request_id(),
            deadline=convert.deadline(context.time_remaining()),
        )
        if outcome.timings is not None:
            headers = tgi_json.timing_headers(
                self._compute_type(),
                len(request.input.inputs),
                outcome.timings,
                outcome.options.input_length,
                outcome.best.generated_tokens,
            )
            for key, value in headers:
                set_response_header(key, value)
        reply = tgi_json.generate_response(outcome)
        yield HttpBody(content_type=tgi_json.JSON, data=tgi_json.dumps([reply] if array else reply))

    async def _stream(
        self, data: bytes, context: aio.ServicerContext, *, compat: bool = False
    ) -> AsyncIterator[HttpBody]:
        """TGI's SSE: 200 always; one StreamResponse per token, or an error event."""
        set_response_header("x-accel-buffering", "no")
        set_response_header("x-compute-type", self._compute_type())
        try:
            body = tgi_json.body_object(data)
            request = tgi_json.generate_from(body)
            if compat:
                request = tgi_json.with_default_full_text(request, body, self._full_text_default())
            set_response_header("x-compute-characters", str(len(request.input.inputs)))
            items = self._text.generation.stream(
                request.input,
                request_id=current_request_id(),
                deadline=convert.deadline(context.time_remaining()),
            )
            async with aclosing(items):
                async for item in items:
                    batch: list[StreamItem] = [item]
                    if request.coalesce_tokens:
                        # Tokens that queued up while the client read: one event for them all.
                        while item.backlog and item.finished is None:
                            item = await anext(items)
                            batch.append(item)
                    event = tgi_json.stream_event(batch, request.coalesce_tokens)
                    yield HttpBody(content_type=tgi_json.EVENT_STREAM, data=tgi_json.sse(event))
        except Exception as error:  # noqa: BLE001 - every error becomes TGI's error event
            if not is_domain_error(error):
                _log.exception("unexpected error serving %s", current_request_id())
            yield HttpBody(content_type=tgi_json.EVENT_STREAM, data=tgi_json.error_event(error))

    # --- model, health, metrics ------------------------------------------------------------

    async def Info(self, request: HttpBody, context: aio.ServicerContext) -> AsyncIterator[HttpBody]:
        async def info() -> AsyncIterator[HttpBody]:
            body = tgi_json.info(self._text.server_info(), self._text.generation.adapters())
            yield HttpBody(content_type=tgi_json.JSON, data=tgi_json.dumps(body))

        async for reply in _json_route(info()):
            yield reply

    async def Health(
        self, request: HttpBody, context: aio.ServicerContext
    ) -> AsyncIterator[HttpBody]:
        health = self._text.health
        if health.serving:
            # TGI answers an empty 200 (no body, no content type of its own).
            yield HttpBody(content_type="text/plain; charset=utf-8", data=b"")
            return
        # TGI's body for a failed health check; the reason says why (warming up, draining...).
        set_response_header(HTTP_STATUS_HEADER, "503")
        body = {"error": f"unhealthy: {health.reason}", "error_type": "healthcheck"}
        yield HttpBody(content_type=tgi_json.JSON, data=tgi_json.dumps(body))

    async def Ping(self, request: HttpBody, context: aio.ServicerContext) -> AsyncIterator[HttpBody]:
        async for reply in self.Health(request, context):
            yield reply

    async def Metrics(
        self, request: HttpBody, context: aio.ServicerContext
    ) -> AsyncIterator[HttpBody]:
        async def metrics() -> AsyncIterator[HttpBody]:
            render = self._options.metrics_text
            if render is None:
                raise ShardUnavailableError("metrics are not available on this server")
            yield HttpBody(content_type=tgi_json.TEXT, data=await render())

        async for reply in _json_route(metrics()):
            yield reply

    async def ChatTokenize(
        self, request: HttpBody, context: aio.ServicerContext
    ) -> AsyncIterator[HttpBody]:
        async for reply in _json_route(self._chat_tokenize(request.data)):
            yield reply

    async def _chat_tokenize(self, data: bytes) -> AsyncIterator[HttpBody]:
        body = tgi_json.body_object(data)
        body.setdefault("model", TGI_MODEL_ALIAS)  # optional in TGI's ChatRequest
        if self._openai is None:
            raise ShardUnavailableError("chat templates are not served by this server")
        templated = await self._openai.endpoints.chat_prompt(chat_request(json.dumps(body).encode()))
        tokens = await self._text.tokenizer.tokenize(templated, False)
        reply = {
            "tokenize_response": [
                {"id": i, "text": text, "start": start, "stop": stop}
                for i, text, start, stop in tokens
            ],
            "templated_text": templated,
        }
        yield HttpBody(content_type=tgi_json.JSON, data=tgi_json.dumps(reply))

    async def OpenApi(
        self, request: HttpBody, context: aio.ServicerContext
    ) -> AsyncIterator[HttpBody]:
        yield HttpBody(content_type=tgi_json.JSON, data=openapi_document())


async def _raise(error: Exception) -> AsyncIterator[HttpBody]:
    raise error
    yield  # pragma: no cover - makes this an async generator


async def _json_route(replies: AsyncIterator[HttpBody]) -> AsyncIterator[HttpBody]:
    """Passes a JSON route's answer through; an error before it becomes TGI's error body with
    its status (422, 424, 429, 503, ...)."""
    try:
        async with aclosing(replies):  # type: ignore[type-var]
            async for reply in replies:
                yield reply
    except Exception as error:  # noqa: BLE001 - every error becomes TGI's error body
        if not is_domain_error(error):
            _log.exception("unexpected error serving %s", current_request_id())
        status, data = tgi_json.error_body(error)
        set_response_header(HTTP_STATUS_HEADER, str(status))
        yield HttpBody(content_type=tgi_json.JSON, data=data)
