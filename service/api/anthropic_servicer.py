"""The servicer of `tokenwire.v1.AnthropicService` (POST /v1/messages and
/v1/messages/count_tokens), thin over the chat endpoints (`OpenAIEndpoints`): the same engine
path as chat completions, Anthropic's bytes in and out.

Every error is answered here as Anthropic's error body with its HTTP status in
`x-tokenwire-http-status`; a stream that fails after message_start ends with an `error` event.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from google.api.httpbody_pb2 import HttpBody
from grpc import aio
from tokenwire.v1 import anthropic_pb2_grpc

from service.api import anthropic_json, convert
from service.api.interceptors import current_request_id, set_response_header
from service.api.openai_servicer import HTTP_STATUS_HEADER
from service.api.status import is_domain_error
from service.engine.contracts import ShardUnavailableError
from service.generation.openai import OpenAIEndpoints

MESSAGES = "messages"  # metrics label of the route (unary)
MESSAGES_STREAM = "messages_stream"
_log = logging.getLogger("tokenwire.router")


class AnthropicServicer(anthropic_pb2_grpc.AnthropicServiceServicer):
    """tokenwire.v1.AnthropicService over OpenAIEndpoints (attached once the shards are warm)."""

    def __init__(self) -> None:
        self._endpoints_or_none: OpenAIEndpoints | None = None

    def attach(self, endpoints: OpenAIEndpoints) -> None:
        self._endpoints_or_none = endpoints

    @property
    def _endpoints(self) -> OpenAIEndpoints:
        if self._endpoints_or_none is None:
            raise ShardUnavailableError("not serving yet: starting")
        return self._endpoints_or_none

    async def Messages(
        self, request: HttpBody, context: aio.ServicerContext
    ) -> AsyncIterator[HttpBody]:
        writer: anthropic_json.EventWriter | None = None
        try:
            decoded = anthropic_json.messages_request(request.data)
            endpoints = self._endpoints
            request_id = current_request_id()
            deadline = convert.deadline(context.time_remaining())
            message = anthropic_json.message_id(request_id)
            if not decoded.stream:
                completed = await endpoints.chat(
                    decoded.chat, request_id=request_id, deadline=deadline, method=MESSAGES
                )
                data = anthropic_json.message_body(message, completed)
                yield HttpBody(content_type=anthropic_json.JSON, data=data)
                return
            header, events = await endpoints.chat_stream(
                decoded.chat, request_id=request_id, deadline=deadline, method=MESSAGES_STREAM
            )
            writer = anthropic_json.EventWriter(message, header.model, header.prompt_tokens or 0)
            yield HttpBody(content_type=anthropic_json.EVENT_STREAM, data=writer.start())
            async with aclosing(events):  # type: ignore[type-var]
                async for event in events:
                    data = writer.push(event)
                    if data:
                        yield HttpBody(content_type=anthropic_json.EVENT_STREAM, data=data)
        except Exception as error:  # noqa: BLE001 - every error becomes an Anthropic error body
            if not is_domain_error(error):
                _log.exception("unexpected error serving %s", current_request_id())
            if writer is not None:
                yield HttpBody(content_type=anthropic_json.EVENT_STREAM, data=writer.failed(error))
                return
            status, body = anthropic_json.error_body(error)
            set_response_header(HTTP_STATUS_HEADER, str(status))
            yield HttpBody(content_type=anthropic_json.JSON, data=body)

    async def CountTokens(
        self, request: HttpBody, context: aio.ServicerContext
    ) -> AsyncIterator[HttpBody]:
        try:
            chat = anthropic_json.count_tokens_request(request.data)
            tokens = await self._endpoints.count_prompt_tokens(chat)
            yield HttpBody(content_type=anthropic_json.JSON,
                           data=anthropic_json.count_tokens_body(tokens))  # fmt: skip
        except Exception as error:  # noqa: BLE001 - every error becomes an Anthropic error body
            if not is_domain_error(error):
                _log.exception("unexpected error serving %s", current_request_id())
            status, body = anthropic_json.error_body(error)
            set_response_header(HTTP_STATUS_HEADER, str(status))
            yield HttpBody(content_type=anthropic_json.JSON, data=body)
