"""Blocking client over grpcio, built on the generated `TextGenerationSyncStub`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, NamedTuple, Self

import grpc

from ._agents import json_reply, request_body, sse_events
from ._errors import TokenwireError, UnavailableError, error_for_event, error_for_status
from ._generated.tokenwire.v1 import (
    AnthropicServiceSyncStub,
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    DeleteResponseRequest,
    GenerateResponse,
    GenerateStreamResponse,
    GetResponseRequest,
    InfoResponse,
    OpenAiServiceSyncStub,
    ResponsesServiceSyncStub,
    TextGenerationSyncStub,
)
from ._images import Prompt
from ._request import (
    auth_metadata,
    build_chat_request,
    build_completion_request,
    build_request,
)

# The model name every tokenwire server accepts for the model it serves.
SERVED_MODEL = "tgi"


class _CallDetails(NamedTuple):
    # Field names are the attributes grpc.ClientCallDetails promises.
    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class _ClientCallDetails(_CallDetails, grpc.ClientCallDetails):
    pass


class _CallOptions(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Applies one call's timeout and metadata (the generated sync stub takes neither) and keeps
    the streaming call object so that the stream can be cancelled."""

    def __init__(self, timeout: float | None, metadata: list[tuple[str, str]]) -> None:
        self.timeout = timeout
        self.metadata = metadata
        self.call: grpc.Call | None = None

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), *self.metadata]
        return _ClientCallDetails(
            details.method,
            self.timeout if self.timeout is not None else details.timeout,
            metadata or None,
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        call = continuation(self._details(client_call_details), request)
        self.call = call
        return call


def _translate(error: grpc.RpcError) -> TokenwireError:
    code = error.code() if isinstance(error, grpc.Call) else None
    message = (error.details() if isinstance(error, grpc.Call) else None) or str(error)
    return error_for_status(code.name if code is not None else "UNKNOWN", message)


class Stream(Iterator[GenerateStreamResponse]):
    """The events of one GenerateStream call (or the chunks of a ChatStream / CompletionStream
    call, which carry in-band errors the same way).

    Iterate it for `GenerateStreamResponse` events; the last one carries `generated_text` (and
    `details` when asked for). Call `cancel()` (or leave a `with` block) to stop early: the server
    stops generating for this request. Errors, including one reported in band after the first
    event, are raised as `TokenwireError` subclasses while iterating.
    """

    def __init__(self, events: Iterator[GenerateStreamResponse], options: _CallOptions) -> None:
        self._events = events
        self._options = options
        self._done = False

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> GenerateStreamResponse:
        if self._done:
            raise StopIteration
        try:
            event = next(self._events)
        except StopIteration:
            self._done = True
            raise
        except grpc.RpcError as error:
            self._done = True
            raise _translate(error) from None
        if event.error is not None:
            self.cancel()
            raise error_for_event(event.error_type, event.error)
        return event

    def cancel(self) -> None:
        """Stops the stream; the server cancels the request. Safe to call more than once."""
        self._done = True
        call = self._options.call
        if call is not None:
            call.cancel()
        close = getattr(self._events, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()


class Client:
    """Blocking tokenwire client.

    `target` is "host:port" of the router (or of Envoy's gRPC port). `api_key` is sent as
    `authorization: Bearer <key>`. `timeout` (seconds) is the default deadline of every call,
    streams included; None means no deadline. Use as a context manager or call `close()`.
    """

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        tls: bool = False,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.target = target
        self.timeout = timeout
        self._metadata = auth_metadata(api_key)
        if tls:
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(), options)
        else:
            self._channel = grpc.insecure_channel(target, options)

    def _stub(self, timeout: float | None) -> tuple[TextGenerationSyncStub, _CallOptions]:
        options = _CallOptions(self.timeout if timeout is None else timeout, self._metadata)
        return TextGenerationSyncStub(grpc.intercept_channel(self._channel, options)), options

    def generate(
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
        stub, _ = self._stub(timeout)
        try:
            return stub.generate(request)
        except grpc.RpcError as error:
            raise _translate(error) from None

    def generate_stream(
        self, inputs: Prompt, *, timeout: float | None = None, **parameters: Any
    ) -> Stream:
        """Starts a streaming generation; returns a `Stream` of events (one per token).

        Takes the same arguments as `generate`. The call starts when iteration starts.
        """
        request = build_request(inputs, parameters)
        stub, options = self._stub(timeout)
        return Stream(stub.generate_stream(request), options)

    def _openai(self, timeout: float | None) -> tuple[OpenAiServiceSyncStub, _CallOptions]:
        options = _CallOptions(self.timeout if timeout is None else timeout, self._metadata)
        return OpenAiServiceSyncStub(grpc.intercept_channel(self._channel, options)), options

    def chat(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        *,
        model: str = SERVED_MODEL,
        timeout: float | None = None,
        **parameters: Any,
    ) -> ChatResponse:
        """A chat completion (tokenwire.v1.OpenAIService/Chat), returned when finished.

        `messages`: {"role", "content"} mappings or ChatMessage objects; `content` is a str or
        OpenAI's list of parts (`{"type": "text", "text": ...}`, `{"type": "image_url",
        "image_url": {"url": ...}}` or an `Image`); `parameters`: ChatRequest
        fields (max_tokens, temperature, top_p, seed, stop, n, logprobs, top_logprobs, ...).
        """
        stub, _ = self._openai(timeout)
        try:
            return stub.chat(build_chat_request(model, messages, parameters))
        except grpc.RpcError as error:
            raise _translate(error) from None

    def chat_stream(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        *,
        model: str = SERVED_MODEL,
        timeout: float | None = None,
        **parameters: Any,
    ) -> Stream:
        """A streamed chat completion: a `Stream` of ChatStreamResponse chunks (the first carries
        the role, each later one `choices[0].delta.content`). Same arguments as `chat`."""
        stub, options = self._openai(timeout)
        request = build_chat_request(model, messages, parameters)
        return Stream(stub.chat_stream(request), options)  # type: ignore[arg-type]

    def completion(
        self,
        prompt: str,
        *,
        model: str = SERVED_MODEL,
        timeout: float | None = None,
        **parameters: Any,
    ) -> CompletionResponse:
        """A completion of a string prompt (tokenwire.v1.OpenAIService/Completion)."""
        stub, _ = self._openai(timeout)
        try:
            return stub.completion(build_completion_request(model, prompt, parameters))
        except grpc.RpcError as error:
            raise _translate(error) from None

    def completion_stream(
        self,
        prompt: str,
        *,
        model: str = SERVED_MODEL,
        timeout: float | None = None,
        **parameters: Any,
    ) -> Stream:
        """A streamed completion: a `Stream` of CompletionStreamResponse chunks."""
        stub, options = self._openai(timeout)
        request = build_completion_request(model, prompt, parameters)
        return Stream(stub.completion_stream(request), options)  # type: ignore[arg-type]

    # --- OpenAI Responses and Anthropic Messages (each API's JSON as dicts) ---------------

    def _options(self, timeout: float | None) -> tuple[grpc.Channel, _CallOptions]:
        options = _CallOptions(self.timeout if timeout is None else timeout, self._metadata)
        return grpc.intercept_channel(self._channel, options), options

    def _json(self, chunks: Iterator[Any]) -> dict[str, Any]:
        try:
            return json_reply(chunks)
        except grpc.RpcError as error:
            raise _translate(error) from None

    def _events(self, chunks: Iterator[Any]) -> Iterator[dict[str, Any]]:
        try:
            yield from sse_events(chunks)
        except grpc.RpcError as error:
            raise _translate(error) from None

    def responses_create(
        self, body: Mapping[str, Any], *, timeout: float | None = None
    ) -> dict[str, Any]:
        """POST /v1/responses (tokenwire.v1.ResponsesService/CreateResponse): `body` is OpenAI's
        request ({"model", "input", "instructions", "tools", "text", "max_output_tokens",
        "previous_response_id", "store", ...}); returns the response object as a dict."""
        channel, _ = self._options(timeout)
        stub = ResponsesServiceSyncStub(channel)
        return self._json(stub.create_response(request_body(body, stream=False)))

    def responses_stream(
        self, body: Mapping[str, Any], *, timeout: float | None = None
    ) -> Iterator[dict[str, Any]]:
        """The same request streamed: OpenAI's semantic events as dicts (`type`:
        response.created, response.output_text.delta, ..., response.completed). Closing the
        iterator early cancels the request."""
        channel, _ = self._options(timeout)
        stub = ResponsesServiceSyncStub(channel)
        return self._events(stub.create_response(request_body(body, stream=True)))

    def responses_retrieve(
        self, response_id: str, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """GET /v1/responses/{id}: a stored response (NotFoundError when it is not stored)."""
        channel, _ = self._options(timeout)
        stub = ResponsesServiceSyncStub(channel)
        return self._json(stub.get_response(GetResponseRequest(response_id=response_id)))

    def responses_delete(
        self, response_id: str, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """DELETE /v1/responses/{id}: {"id", "object": "response.deleted", "deleted": true}."""
        channel, _ = self._options(timeout)
        stub = ResponsesServiceSyncStub(channel)
        return self._json(stub.delete_response(DeleteResponseRequest(response_id=response_id)))

    def messages_create(
        self, body: Mapping[str, Any], *, timeout: float | None = None
    ) -> dict[str, Any]:
        """POST /v1/messages (tokenwire.v1.AnthropicService/Messages): `body` is Anthropic's
        request ({"model", "max_tokens", "messages", "system", "tools", ...}); returns the
        message object as a dict."""
        channel, _ = self._options(timeout)
        stub = AnthropicServiceSyncStub(channel)
        return self._json(stub.messages(request_body(body, stream=False)))

    def messages_stream(
        self, body: Mapping[str, Any], *, timeout: float | None = None
    ) -> Iterator[dict[str, Any]]:
        """The same request streamed: Anthropic's events as dicts (message_start,
        content_block_delta, ..., message_stop)."""
        channel, _ = self._options(timeout)
        stub = AnthropicServiceSyncStub(channel)
        return self._events(stub.messages(request_body(body, stream=True)))

    def messages_count_tokens(
        self, body: Mapping[str, Any], *, timeout: float | None = None
    ) -> dict[str, Any]:
        """POST /v1/messages/count_tokens: {"input_tokens": N} of the rendered prompt."""
        channel, _ = self._options(timeout)
        stub = AnthropicServiceSyncStub(channel)
        return self._json(stub.count_tokens(request_body(body)))

    def info(self, *, timeout: float | None = None) -> InfoResponse:
        """Describes the served model and the server's limits."""
        stub, _ = self._stub(timeout)
        try:
            return stub.info()
        except grpc.RpcError as error:
            raise _translate(error) from None

    def health(self, *, timeout: float | None = None) -> bool:
        """True when the server can generate, False when it answers UNAVAILABLE (not ready or a
        shard is down, or nothing listens at `target`). Other failures raise."""
        stub, _ = self._stub(timeout)
        try:
            stub.health()
        except grpc.RpcError as error:
            translated = _translate(error)
            if isinstance(translated, UnavailableError):
                return False
            raise translated from None
        return True

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
