"""The servicer of `tokenwire.v1.ResponsesService` (POST, GET, DELETE /v1/responses), thin over
`service.generation.responses.ResponsesEndpoints`.

As the OpenAI chat route (service.api.openai_servicer), every error is answered here as an
OpenAI error body whose HTTP status goes out in `x-tokenwire-http-status`; a stream that fails
after its first event ends with an `error` event and `response.failed`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from google.api.httpbody_pb2 import HttpBody
from grpc import aio
from tokenwire.v1 import responses_pb2 as pb
from tokenwire.v1 import responses_pb2_grpc

from service.api import convert, responses_json
from service.api.interceptors import current_request_id, set_response_header
from service.api.openai_json import error_body
from service.api.openai_servicer import HTTP_STATUS_HEADER
from service.api.status import is_domain_error
from service.engine.contracts import ShardUnavailableError
from service.generation.errors import ValidationError
from service.generation.openai import ChatMessage
from service.generation.responses import ResponsesEndpoints, new_response_id, output_message

_log = logging.getLogger("tokenwire.router")


class ResponsesServicer(responses_pb2_grpc.ResponsesServiceServicer):
    """tokenwire.v1.ResponsesService over ResponsesEndpoints (attached once the shards are
    warm)."""

    def __init__(self) -> None:
        self._endpoints_or_none: ResponsesEndpoints | None = None

    def attach(self, endpoints: ResponsesEndpoints) -> None:
        self._endpoints_or_none = endpoints

    @property
    def _endpoints(self) -> ResponsesEndpoints:
        if self._endpoints_or_none is None:
            raise ShardUnavailableError("not serving yet: starting")
        return self._endpoints_or_none

    async def CreateResponse(
        self, request: HttpBody, context: aio.ServicerContext
    ) -> AsyncIterator[HttpBody]:
        writer: responses_json.EventWriter | None = None
        try:
            decoded = responses_json.create_request(request.data)
            endpoints = self._endpoints
            conversation = endpoints.conversation(decoded.request)
            chat = endpoints.chat_request(decoded.request, conversation)
            response_id = new_response_id()
            kwargs = {
                "request_id": current_request_id(),
                "deadline": convert.deadline(context.time_remaining()),
            }
            if not decoded.stream:
                completed = await endpoints.create(chat, **kwargs)  # type: ignore[arg-type]
                body = responses_json.response_body(response_id, decoded.echo, completed)
                output = output_message(completed.choices[0])
                endpoints.remember(response_id, decoded.request, conversation, output, body)
                yield HttpBody(content_type=responses_json.JSON, data=responses_json.encode(body))
                return
            header, events = await endpoints.create_stream(chat, **kwargs)  # type: ignore[arg-type]
            writer = responses_json.EventWriter(response_id, header.model, decoded.echo,
                                                header.created)  # fmt: skip
            yield HttpBody(content_type=responses_json.EVENT_STREAM, data=writer.start())
            async with aclosing(events):  # type: ignore[type-var]
                async for event in events:
                    data = writer.push(event)
                    if data:
                        yield HttpBody(content_type=responses_json.EVENT_STREAM, data=data)
            if writer.final is not None:
                output = ChatMessage("assistant", writer.text, tool_calls=tuple(writer.calls))
                endpoints.remember(response_id, decoded.request, conversation, output,
                                   writer.final)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - every error becomes an OpenAI error body
            if not is_domain_error(error):
                _log.exception("unexpected error serving %s", current_request_id())
            if writer is not None:
                yield HttpBody(content_type=responses_json.EVENT_STREAM, data=writer.failed(error))
                return
            status, body = error_body(_as_input(error))
            set_response_header(HTTP_STATUS_HEADER, str(status))
            yield HttpBody(content_type=responses_json.JSON, data=body)

    async def GetResponse(
        self, request: pb.GetResponseRequest, context: aio.ServicerContext
    ) -> AsyncIterator[HttpBody]:
        stored = self._endpoints.get(request.response_id)
        if stored is None:
            status, body = responses_json.not_found_body(request.response_id)
            set_response_header(HTTP_STATUS_HEADER, str(status))
            yield HttpBody(content_type=responses_json.JSON, data=body)
            return
        yield HttpBody(content_type=responses_json.JSON, data=responses_json.encode(stored.body))

    async def DeleteResponse(
        self, request: pb.DeleteResponseRequest, context: aio.ServicerContext
    ) -> AsyncIterator[HttpBody]:
        if not self._endpoints.delete(request.response_id):
            status, body = responses_json.not_found_body(request.response_id)
            set_response_header(HTTP_STATUS_HEADER, str(status))
            yield HttpBody(content_type=responses_json.JSON, data=body)
            return
        yield HttpBody(
            content_type=responses_json.JSON, data=responses_json.deleted_body(request.response_id)
        )


def _as_input(error: Exception) -> Exception:
    """The chat path names the conversation `messages`; here it is `input`."""
    if isinstance(error, ValidationError) and error.field == "messages":
        return ValidationError("input", str(error).replace("messages", "input"))
    return error
