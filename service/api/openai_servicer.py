"""The servicer of `tokenwire.v1.OpenAIService`: the typed RPCs and the HttpBody RPCs behind
Envoy's /v1 routes, both thin over `service.generation.openai.OpenAIEndpoints`.

The HttpBody RPCs answer every error themselves, as an OpenAI error body whose HTTP status goes
out in the `x-tokenwire-http-status` response header (Envoy's Lua filter sets the status from
it): a gRPC error would reach HTTP clients in the transcoder's `{"code","message"}` shape. A
stream that fails after its first chunk ends with an in-band error event, then `data: [DONE]`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

from google.api.httpbody_pb2 import HttpBody
from grpc import aio
from tokenwire.v1 import openai_pb2 as pb
from tokenwire.v1 import openai_pb2_grpc

from service.api import convert, openai_convert, openai_json
from service.api.interceptors import current_request_id, set_response_header
from service.api.status import classify, is_domain_error, public_message
from service.engine.contracts import ShardUnavailableError
from service.generation.openai import (
    ChatRequest,
    Completed,
    CompletionRequest,
    OpenAIEndpoints,
    ResponseHeader,
    StreamEvent,
)

HTTP_STATUS_HEADER = "x-tokenwire-http-status"
_log = logging.getLogger("tokenwire.router")

_Request = TypeVar("_Request", ChatRequest, CompletionRequest)
_Chunk = TypeVar("_Chunk", pb.ChatStreamResponse, pb.CompletionStreamResponse)


class OpenAIServicer(openai_pb2_grpc.OpenAIServiceServicer):
    """tokenwire.v1.OpenAIService over OpenAIEndpoints (attached once the shards are warm)."""

    def __init__(self) -> None:
        self._endpoints_or_none: OpenAIEndpoints | None = None

    def attach(self, endpoints: OpenAIEndpoints) -> None:
        self._endpoints_or_none = endpoints

    @property
    def endpoints(self) -> OpenAIEndpoints:
        """The domain object; ShardUnavailableError until attached."""
        return self._endpoints

    @property
    def _endpoints(self) -> OpenAIEndpoints:
        if self._endpoints_or_none is None:
            raise ShardUnavailableError("not serving yet: starting")
        return self._endpoints_or_none

    # --- REST (HttpBody) -------------------------------------------------------------------

    async def ChatCompletions(
        self, request: HttpBody, context: aio.ServicerContext
    ) -> AsyncIterator[HttpBody]:
        async for body in self._http(
            request,
            context,
            openai_json.chat_request,
            lambda e: e.chat,
            lambda e: e.chat_stream,
            openai_json.chat_completion,
            openai_json.chat_chunk,
        ):
            yield body

    async def Completions(
        self, request: HttpBody, context: aio.ServicerContext
    ) -> AsyncIterator[HttpBody]:
        async for body in self._http(
            request,
            context,
            openai_json.completion_request,
            lambda e: e.completion,
            lambda e: e.completion_stream,
            openai_json.text_completion,
            openai_json.completion_chunk,
        ):
            yield body

    async def with_errors(
        self,
        request: HttpBody,
        context: aio.ServicerContext,
        *,
        chat: bool,
        error_body: Callable[[BaseException], tuple[int, bytes]],
        error_event: Callable[[BaseException], bytes],
    ) -> AsyncIterator[HttpBody]:
        """ChatCompletions (`chat`) or Completions answering errors in another API's shape
        (TGI's POST /invocations, whose clients parse TGI's error bodies)."""
        if chat:
            route = (openai_json.chat_request, lambda e: e.chat, lambda e: e.chat_stream,
                     openai_json.chat_completion, openai_json.chat_chunk)  # fmt: skip
        else:
            route = (openai_json.completion_request, lambda e: e.completion,  # type: ignore[assignment]
                     lambda e: e.completion_stream, openai_json.text_completion,
                     openai_json.completion_chunk)  # fmt: skip
        async for body in self._http(request, context, *route,  # type: ignore[arg-type]
                                     error_body=error_body, error_event=error_event):  # fmt: skip
            yield body

    async def _http(
        self,
        request: HttpBody,
        context: aio.ServicerContext,
        decode: Callable[[bytes], _Request],
        unary: Callable[[OpenAIEndpoints], Callable[..., Awaitable[Completed]]],
        stream: Callable[
            [OpenAIEndpoints],
            Callable[..., Awaitable[tuple[ResponseHeader, AsyncIterator[StreamEvent]]]],
        ],
        encode: Callable[[Completed], bytes],
        encode_chunk: Callable[[ResponseHeader, StreamEvent, bool], bytes],
        *,
        error_body: Callable[[BaseException], tuple[int, bytes]] = openai_json.error_body,
        error_event: Callable[[BaseException], bytes] = openai_json.error_event,
    ) -> AsyncIterator[HttpBody]:
        sent = False
        try:
            parsed = decode(request.data)
            endpoints = self._endpoints
            kwargs = {
                "request_id": current_request_id(),
                "deadline": convert.deadline(context.time_remaining()),
            }
            if not parsed.params.stream:
                completed = await unary(endpoints)(parsed, **kwargs)
                yield HttpBody(content_type=openai_json.JSON, data=encode(completed))
                return
            header, events = await stream(endpoints)(parsed, **kwargs)
            usage = parsed.params.include_usage
            async with aclosing(events):  # type: ignore[type-var]
                async for event in events:
                    data = encode_chunk(header, event, usage)
                    yield HttpBody(content_type=openai_json.EVENT_STREAM, data=data)
                    sent = True
            yield HttpBody(content_type=openai_json.EVENT_STREAM, data=openai_json.DONE)
        except Exception as error:  # noqa: BLE001 - every error becomes an OpenAI error body
            if not is_domain_error(error):
                _log.exception("unexpected error serving %s", current_request_id())
            if sent:
                data = error_event(error) + openai_json.DONE
                yield HttpBody(content_type=openai_json.EVENT_STREAM, data=data)
                return
            status, body = error_body(error)
            set_response_header(HTTP_STATUS_HEADER, str(status))
            yield HttpBody(content_type=openai_json.JSON, data=body)

    # --- typed -----------------------------------------------------------------------------

    async def ListModels(
        self, request: pb.ListModelsRequest, context: aio.ServicerContext
    ) -> pb.ListModelsResponse:
        endpoints = self._endpoints
        return openai_convert.models_response(
            endpoints.model_id, endpoints.created, [a.name for a in endpoints.service.adapters()]
        )

    async def Chat(self, request: pb.ChatRequest, context: aio.ServicerContext) -> pb.ChatResponse:
        completed = await self._endpoints.chat(
            openai_convert.chat_request(request, stream=False),
            request_id=current_request_id(),
            deadline=convert.deadline(context.time_remaining()),
        )
        return openai_convert.chat_response(completed)

    async def ChatStream(
        self, request: pb.ChatRequest, context: aio.ServicerContext
    ) -> AsyncIterator[pb.ChatStreamResponse]:
        header, events = await self._endpoints.chat_stream(
            openai_convert.chat_request(request, stream=True),
            request_id=current_request_id(),
            deadline=convert.deadline(context.time_remaining()),
        )
        async for chunk in _typed_stream(
            header, events, openai_convert.chat_chunk, pb.ChatStreamResponse
        ):
            yield chunk

    async def Completion(
        self, request: pb.CompletionRequest, context: aio.ServicerContext
    ) -> pb.CompletionResponse:
        completed = await self._endpoints.completion(
            openai_convert.completion_request(request, stream=False),
            request_id=current_request_id(),
            deadline=convert.deadline(context.time_remaining()),
        )
        return openai_convert.completion_response(completed)

    async def CompletionStream(
        self, request: pb.CompletionRequest, context: aio.ServicerContext
    ) -> AsyncIterator[pb.CompletionStreamResponse]:
        header, events = await self._endpoints.completion_stream(
            openai_convert.completion_request(request, stream=True),
            request_id=current_request_id(),
            deadline=convert.deadline(context.time_remaining()),
        )
        async for chunk in _typed_stream(
            header, events, openai_convert.completion_chunk, pb.CompletionStreamResponse
        ):
            yield chunk


async def _typed_stream(
    header: ResponseHeader,
    events: AsyncIterator[StreamEvent],
    encode: Callable[[ResponseHeader, StreamEvent], _Chunk],
    chunk_type: type[_Chunk],
) -> AsyncIterator[_Chunk]:
    """Encodes a stream's events; a failure after the first chunk is also reported in band."""
    sent = False
    async with aclosing(events):  # type: ignore[type-var]
        try:
            async for event in events:
                yield encode(header, event)
                sent = True
        except Exception as error:
            if sent:
                yield chunk_type(
                    id=header.id,
                    model=header.model,
                    error=public_message(error),
                    error_type=classify(error).error_type,
                )
            raise
