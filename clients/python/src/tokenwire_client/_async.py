"""asyncio client over grpclib, built on the generated `TextGenerationStub`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

from grpclib.client import Channel
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from ._agents import json_reply_async, request_body, sse_events_async
from ._errors import (
    DeadlineExceededError,
    TokenwireError,
    UnavailableError,
    error_for_event,
    error_for_status,
)
from ._generated.tokenwire.v1 import (
    AnthropicServiceStub,
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    DeleteResponseRequest,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamResponse,
    GetResponseRequest,
    InfoResponse,
    OpenAiServiceStub,
    ResponsesServiceStub,
    TextGenerationStub,
)
from ._images import Prompt
from ._request import (
    auth_metadata,
    build_chat_request,
    build_completion_request,
    build_request,
)
from ._sync import SERVED_MODEL


def split_target(target: str) -> tuple[str, int]:
    """Splits "host:port" (or "[v6addr]:port") as grpcio accepts it, for grpclib."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"target must be host:port, got {target!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "localhost", int(port)


def _translate(error: BaseException) -> TokenwireError:
    if isinstance(error, TokenwireError):
        return error
    if isinstance(error, GRPCError):
        return error_for_status(error.status.name, error.message or "")
    if isinstance(error, asyncio.TimeoutError):
        return DeadlineExceededError("deadline exceeded before the call finished")
    # Connection refused or dropped, HTTP/2 protocol failure: the server is not there.
    return UnavailableError(f"{type(error).__name__}: {error}")


# What a call can raise besides our own errors; all of it is translated.
_CALL_ERRORS = (GRPCError, asyncio.TimeoutError, StreamTerminatedError, ProtocolError, OSError)


class AsyncStream(AsyncIterator[GenerateStreamResponse]):
    """The events of one GenerateStream call, for `async for`.

    The last event carries `generated_text` (and `details` when asked for). `await cancel()` (or
    leaving an `async with` block) stops early: the HTTP/2 stream is reset and the server cancels
    the request. Errors, including one reported in band after the first event, are raised as
    `TokenwireError` subclasses while iterating.
    """

    def __init__(self, events: AsyncGenerator[GenerateStreamResponse, None]) -> None:
        self._events = events
        self._done = False

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> GenerateStreamResponse:
        if self._done:
            raise StopAsyncIteration
        try:
            event = await self._events.__anext__()
        except StopAsyncIteration:
            self._done = True
            raise
        except _CALL_ERRORS as error:
            self._done = True
            raise _translate(error) from None
        if event.error is not None:
            await self.cancel()
            raise error_for_event(event.error_type, event.error)
        return event

    async def cancel(self) -> None:
        """Stops the stream; the server cancels the request. Safe to call more than once."""
        self._done = True
        try:
            await self._events.aclose()
        except _CALL_ERRORS:
            pass  # the call was already failing; cancelling it is all that was asked

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.cancel()


class AsyncClient:
    """asyncio tokenwire client (grpclib).

    Same arguments as `Client`: `target` "host:port", `api_key` sent as
    `authorization: Bearer <key>`, `timeout` the default deadline in seconds (None: none). The
    connection opens on the first call, inside the running event loop. Use `async with` or
    call `close()`.
    """

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        tls: bool = False,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self._host, self._port = split_target(target)
        self._tls = tls
        self._metadata = auth_metadata(api_key)
        self._channel: Channel | None = None
        self._service: TextGenerationStub | None = None
        self._openai_service: OpenAiServiceStub | None = None

    def _connect(self) -> Channel:
        # grpclib binds the channel to the running loop, so it is created on first use.
        if self._channel is None:
            self._channel = Channel(self._host, self._port, ssl=True if self._tls else None)
        return self._channel

    @property
    def _stub(self) -> TextGenerationStub:
        if self._service is None:
            self._service = TextGenerationStub(
                self._connect(), timeout=self.timeout, metadata=self._metadata
            )
        return self._service

    async def generate(
        self, inputs: Prompt, *, timeout: float | None = None, **parameters: Any
    ) -> GenerateResponse:
        """Generates a completion for `inputs` and returns it when it is finished.

        `inputs` is the prompt: a str, or a sequence of parts, text (str) and images (`Image`,
        `ImagePart`, bytes or a pathlib.Path of an image file) in order, for vision-language
        models: `["What is in ", Image.from_file("cat.png"), "?"]`.
        `parameters` are GenerateParameters fields (max_new_tokens, temperature, stop, details,
        seed, grammar, ...); `timeout` overrides the client's default deadline for this call.
        """
        request = build_request(inputs, parameters)
        try:
            return await self._stub.generate(request, timeout=timeout)
        except _CALL_ERRORS as error:
            raise _translate(error) from None

    def generate_stream(
        self, inputs: Prompt, *, timeout: float | None = None, **parameters: Any
    ) -> AsyncStream:
        """Starts a streaming generation; returns an `AsyncStream` of events (one per token).

        Takes the same arguments as `generate`. The call starts when iteration starts.
        """
        request: GenerateRequest = build_request(inputs, parameters)
        events = self._stub.generate_stream(request, timeout=timeout)
        return AsyncStream(events)  # type: ignore[arg-type]

    @property
    def _openai(self) -> OpenAiServiceStub:
        if self._openai_service is None:
            self._stub  # noqa: B018 - opens the channel in the running loop
            self._openai_service = OpenAiServiceStub(
                self._channel,
                timeout=self.timeout,
                metadata=self._metadata,  # type: ignore[arg-type]
            )
        return self._openai_service

    async def chat(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        *,
        model: str = SERVED_MODEL,
        timeout: float | None = None,
        **parameters: Any,
    ) -> ChatResponse:
        """A chat completion, returned when finished (see `Client.chat`)."""
        request = build_chat_request(model, messages, parameters)
        try:
            return await self._openai.chat(request, timeout=timeout)
        except _CALL_ERRORS as error:
            raise _translate(error) from None

    def chat_stream(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        *,
        model: str = SERVED_MODEL,
        timeout: float | None = None,
        **parameters: Any,
    ) -> AsyncStream:
        """A streamed chat completion: an `AsyncStream` of ChatStreamResponse chunks."""
        request = build_chat_request(model, messages, parameters)
        return AsyncStream(self._openai.chat_stream(request, timeout=timeout))  # type: ignore[arg-type]

    async def completion(
        self,
        prompt: str,
        *,
        model: str = SERVED_MODEL,
        timeout: float | None = None,
        **parameters: Any,
    ) -> CompletionResponse:
        """A completion of a string prompt, returned when finished."""
        request = build_completion_request(model, prompt, parameters)
        try:
            return await self._openai.completion(request, timeout=timeout)
        except _CALL_ERRORS as error:
            raise _translate(error) from None

    def completion_stream(
        self,
        prompt: str,
        *,
        model: str = SERVED_MODEL,
        timeout: float | None = None,
        **parameters: Any,
    ) -> AsyncStream:
        """A streamed completion: an `AsyncStream` of CompletionStreamResponse chunks."""
        request = build_completion_request(model, prompt, parameters)
        return AsyncStream(self._openai.completion_stream(request, timeout=timeout))  # type: ignore[arg-type]

    # --- OpenAI Responses and Anthropic Messages (each API's JSON as dicts) ---------------

    def _responses(self) -> ResponsesServiceStub:
        self._stub  # noqa: B018 - opens the channel in the running loop
        return ResponsesServiceStub(self._channel, timeout=self.timeout,  # type: ignore[arg-type]
                                    metadata=self._metadata)  # fmt: skip

    def _anthropic(self) -> AnthropicServiceStub:
        self._stub  # noqa: B018 - opens the channel in the running loop
        return AnthropicServiceStub(self._channel, timeout=self.timeout,  # type: ignore[arg-type]
                                    metadata=self._metadata)  # fmt: skip

    async def _json(self, chunks: AsyncIterator[Any]) -> dict[str, Any]:
        try:
            return await json_reply_async(chunks)
        except _CALL_ERRORS as error:
            raise _translate(error) from None

    async def _events(self, chunks: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            async for event in sse_events_async(chunks):
                yield event
        except _CALL_ERRORS as error:
            raise _translate(error) from None

    async def responses_create(
        self, body: Mapping[str, Any], *, timeout: float | None = None
    ) -> dict[str, Any]:
        """POST /v1/responses as a dict (see `Client.responses_create`)."""
        stub = self._responses()
        return await self._json(
            stub.create_response(request_body(body, stream=False), timeout=timeout)
        )

    def responses_stream(
        self, body: Mapping[str, Any], *, timeout: float | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """OpenAI's semantic events of a streamed response, as dicts."""
        stub = self._responses()
        return self._events(stub.create_response(request_body(body, stream=True), timeout=timeout))

    async def responses_retrieve(
        self, response_id: str, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """A stored response (NotFoundError when it is not stored)."""
        request = GetResponseRequest(response_id=response_id)
        return await self._json(self._responses().get_response(request, timeout=timeout))

    async def responses_delete(
        self, response_id: str, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """Deletes a stored response."""
        request = DeleteResponseRequest(response_id=response_id)
        return await self._json(self._responses().delete_response(request, timeout=timeout))

    async def messages_create(
        self, body: Mapping[str, Any], *, timeout: float | None = None
    ) -> dict[str, Any]:
        """POST /v1/messages as a dict (see `Client.messages_create`)."""
        stub = self._anthropic()
        return await self._json(stub.messages(request_body(body, stream=False), timeout=timeout))

    def messages_stream(
        self, body: Mapping[str, Any], *, timeout: float | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Anthropic's events of a streamed message, as dicts."""
        stub = self._anthropic()
        return self._events(stub.messages(request_body(body, stream=True), timeout=timeout))

    async def messages_count_tokens(
        self, body: Mapping[str, Any], *, timeout: float | None = None
    ) -> dict[str, Any]:
        """{"input_tokens": N} of the rendered prompt."""
        stub = self._anthropic()
        return await self._json(stub.count_tokens(request_body(body), timeout=timeout))

    async def info(self, *, timeout: float | None = None) -> InfoResponse:
        """Describes the served model and the server's limits."""
        try:
            return await self._stub.info(timeout=timeout)
        except _CALL_ERRORS as error:
            raise _translate(error) from None

    async def health(self, *, timeout: float | None = None) -> bool:
        """True when the server can generate, False when it answers UNAVAILABLE (not ready or a
        shard is down, or nothing listens at `target`). Other failures raise."""
        try:
            await self._stub.health(timeout=timeout)
        except _CALL_ERRORS as error:
            translated = _translate(error)
            if isinstance(translated, UnavailableError):
                return False
            raise translated from None
        return True

    def close(self) -> None:
        """Closes the connection; calls in flight fail."""
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._service = None
        self._openai_service = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
