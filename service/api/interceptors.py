"""Server interceptors of the public API: request ids, API-key auth, and the ONE place where
domain errors become gRPC status codes.

Order them outermost first: `[RequestIdInterceptor(), ErrorInterceptor(), AuthInterceptor(key)]`,
so that every failure (auth included) is mapped and every answer carries its request id.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc
from grpc import aio

from service.api.status import classify, is_domain_error, public_message
from service.generation.errors import UnauthenticatedError

REQUEST_ID_KEY = "x-request-id"
# Health and reflection stay open without an API key (probes, grpcurl/buf curl discovery).
OPEN_METHOD_PREFIXES: tuple[str, ...] = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.",
    "/tokenwire.v1.TextGeneration/Health",
)
_VALID_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar(
    "tokenwire_request_id", default=""
)
# Extra initial-metadata entries of the streaming call being served (see set_response_header).
_response_headers: contextvars.ContextVar[list[tuple[str, str]] | None] = contextvars.ContextVar(
    "tokenwire_response_headers", default=None
)
_log = logging.getLogger("tokenwire.grpc")

Unary = Callable[[Any, aio.ServicerContext], Awaitable[Any]]
Streaming = Callable[[Any, aio.ServicerContext], AsyncIterator[Any]]


def current_request_id() -> str:
    """The request id of the call being served (set by RequestIdInterceptor); a fresh one when
    called outside an intercepted call."""
    return _request_id.get() or uuid.uuid4().hex


def set_response_header(key: str, value: str) -> None:
    """Adds an entry to the initial metadata of the streaming call being served, sent with its
    first message (Envoy turns it into an HTTP response header). Call it before yielding the
    first message; outside a stream served through RequestIdInterceptor it does nothing."""
    headers = _response_headers.get()
    if headers is not None:
        headers.append((key, value))


def _metadata(details: grpc.HandlerCallDetails, key: str) -> str | None:
    for item in details.invocation_metadata or ():
        if item.key == key:
            value = item.value
            return value.decode("latin-1") if isinstance(value, bytes) else value
    return None


class _WrappingInterceptor(aio.ServerInterceptor):
    """Wraps the behaviour of unary-unary and unary-stream handlers; others pass through.

    Unary calls nest one coroutine per interceptor (`around_unary`). Streams are the hot path
    (one message per generated token), so the stream interceptors of a chain are folded into ONE
    async generator over the servicer's: each interceptor contributes hooks run once per call
    (`stream_enter` before the first message, `stream_error` for an exception, `stream_exit`
    at the end), never a per-message layer."""

    def applies(self, method: str) -> bool:
        # Only the public API: grpc health and reflection are served untouched.
        return method.startswith("/tokenwire.")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if (
            handler is None
            or handler.request_streaming
            or not self.applies(handler_call_details.method)
        ):
            return handler
        details = handler_call_details
        if handler.response_streaming:
            inner_stream: Streaming = handler.unary_stream
            layers: tuple[_WrappingInterceptor, ...] = (self,)
            base = getattr(inner_stream, "_tokenwire_base", None)
            if base is not None:  # an inner interceptor of ours: fold into one generator
                layers += inner_stream._tokenwire_layers  # type: ignore[attr-defined]
                inner_stream = base
            stream = _folded_stream(inner_stream, layers, details)
            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        inner_unary: Unary = handler.unary_unary

        async def unary(request: Any, context: aio.ServicerContext) -> Any:
            return await self.around_unary(inner_unary, request, context, details)

        return grpc.unary_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer
        )

    async def around_unary(
        self,
        behavior: Unary,
        request: Any,
        context: aio.ServicerContext,
        details: grpc.HandlerCallDetails,
    ) -> Any:
        return await behavior(request, context)

    # Stream hooks (once per call).
    async def stream_enter(
        self, context: aio.ServicerContext, details: grpc.HandlerCallDetails
    ) -> Any:
        """Before the stream's first message; what it returns is given to `stream_exit`."""
        return None

    async def stream_first(self, context: aio.ServicerContext, state: Any) -> None:
        """Just before the stream's first message goes out (not called for a stream that fails
        or ends before its first message)."""

    async def stream_error(self, error: Exception, context: aio.ServicerContext) -> None:
        """An exception raised inside this interceptor (by inner hooks or the handler): raise
        it or another one (the default re-raises it)."""
        raise error

    def stream_exit(self, state: Any) -> None:
        """At the end of the call, however it ended (only when `stream_enter` returned)."""


def _folded_stream(
    behavior: Streaming, layers: tuple[_WrappingInterceptor, ...], details: grpc.HandlerCallDetails
) -> Streaming:
    """One async generator running `layers` (outermost first) around `behavior`: hooks once per
    call, a single pass-through per message."""

    # grpc.aio needs an async generator *function* to treat the handler as streaming.
    async def stream(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
        entered: list[tuple[_WrappingInterceptor, Any]] = []
        try:
            try:
                for layer in layers:
                    entered.append((layer, await layer.stream_enter(context, details)))
                async with aclosing(behavior(request, context)) as responses:
                    first = True
                    async for response in responses:
                        if first:
                            first = False
                            for layer, state in entered:
                                await layer.stream_first(context, state)
                        yield response
            except Exception as error:
                # Layers entered so far see it, innermost first; the one that raised in its
                # own stream_enter was not entered (as an exception before its wrapper ran).
                current: Exception = error
                for layer, _ in reversed(entered):
                    try:
                        await layer.stream_error(current, context)
                    except Exception as mapped:  # noqa: BLE001
                        current = mapped
                        continue
                    return  # swallowed: the stream ends normally
                if current is error:
                    raise
                raise current from None
        finally:
            for layer, state in reversed(entered):
                layer.stream_exit(state)

    stream._tokenwire_base = behavior  # type: ignore[attr-defined]
    stream._tokenwire_layers = layers  # type: ignore[attr-defined]
    return stream


@dataclass(frozen=True)
class _StreamState:
    request_id: str
    token: contextvars.Token[str]
    headers: list[tuple[str, str]]
    headers_token: contextvars.Token[list[tuple[str, str]] | None]


class RequestIdInterceptor(_WrappingInterceptor):
    """Takes the client's `x-request-id` (printable ASCII, at most 128 characters) or makes one,
    exposes it through `current_request_id()` and echoes it in the response's metadata.

    Unary calls send it in the initial metadata together with their answer, streams together
    with their first event, and both always in the trailing metadata: a call that fails before
    its first message must stay a trailers-only response, or Envoy has already answered HTTP 200
    and can neither map the status (400, 429, ...) nor retry the call on another replica."""

    def _begin(self, details: grpc.HandlerCallDetails) -> tuple[str, contextvars.Token[str]]:
        given = _metadata(details, REQUEST_ID_KEY)
        request_id = given if given and _VALID_REQUEST_ID.match(given) else uuid.uuid4().hex
        return request_id, _request_id.set(request_id)

    async def around_unary(
        self,
        behavior: Unary,
        request: Any,
        context: aio.ServicerContext,
        details: grpc.HandlerCallDetails,
    ) -> Any:
        request_id, token = self._begin(details)
        try:
            # As for streams: nothing is sent before the answer, so a failure stays a
            # trailers-only response, which a gateway may still retry on another replica.
            context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))
            response = await behavior(request, context)
            await context.send_initial_metadata(((REQUEST_ID_KEY, request_id),))
            return response
        finally:
            _request_id.reset(token)

    async def stream_enter(
        self, context: aio.ServicerContext, details: grpc.HandlerCallDetails
    ) -> _StreamState:
        request_id, token = self._begin(details)
        context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))
        headers: list[tuple[str, str]] = []
        return _StreamState(request_id, token, headers, _response_headers.set(headers))

    async def stream_first(self, context: aio.ServicerContext, state: _StreamState) -> None:
        await context.send_initial_metadata(((REQUEST_ID_KEY, state.request_id), *state.headers))

    def stream_exit(self, state: _StreamState) -> None:
        try:
            _request_id.reset(state.token)
            _response_headers.reset(state.headers_token)
        except ValueError:  # closed from another context (generator finalisation)
            pass


class ErrorInterceptor(_WrappingInterceptor):
    """Maps exceptions to status codes (see `service.api.status.classify`); unexpected exceptions are
    logged with their traceback and answered INTERNAL without internals."""

    async def _abort(self, context: aio.ServicerContext, error: Exception) -> None:
        kind = classify(error)
        if not is_domain_error(error):
            _log.exception(
                "unexpected error serving request %s", current_request_id(), exc_info=error
            )
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            # The caller's deadline has passed: its side has ended the call with
            # DEADLINE_EXCEEDED, and a status sent now may find the call closed, which grpc
            # logs as an ExecuteBatchError traceback at ERROR for a routine timeout.
            raise asyncio.CancelledError
        await context.abort(kind.code, public_message(error))

    async def around_unary(
        self,
        behavior: Unary,
        request: Any,
        context: aio.ServicerContext,
        details: grpc.HandlerCallDetails,
    ) -> Any:
        try:
            return await behavior(request, context)
        except aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001 - this is the mapping point
            await self._abort(context, error)

    async def stream_error(self, error: Exception, context: aio.ServicerContext) -> None:
        if isinstance(error, aio.AbortError):
            raise error
        await self._abort(context, error)


class AuthInterceptor(_WrappingInterceptor):
    """Requires `authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on every
    method but health and reflection."""

    def __init__(self, api_key: str) -> None:
        if not api_key:
            raise ValueError("AuthInterceptor needs a non-empty API key")
        self._expected = f"Bearer {api_key}".encode()
        self._expected_key = api_key.encode()

    def applies(self, method: str) -> bool:
        return super().applies(method) and not method.startswith(OPEN_METHOD_PREFIXES)

    def _check(self, details: grpc.HandlerCallDetails) -> None:
        given = _metadata(details, "authorization")
        api_key = _metadata(details, "x-api-key") if given is None else None
        if given is None and api_key is None:
            error = UnauthenticatedError(
                "missing 'authorization: Bearer <api key>' (or 'x-api-key') metadata"
            )
        elif api_key is not None:
            if hmac.compare_digest(api_key.encode("latin-1", "replace"), self._expected_key):
                return
            error = UnauthenticatedError("invalid API key in 'x-api-key' metadata")
        elif not hmac.compare_digest(given.encode("latin-1", "replace"), self._expected):
            error = UnauthenticatedError("invalid API key in 'authorization' metadata")
        else:
            return
        _log.info(
            "request refused",
            extra={
                "fields": {
                    "request_id": current_request_id(),
                    "method": details.method,
                    "status": "unauthenticated",
                    "error": str(error),
                }
            },
        )
        raise error

    async def around_unary(
        self,
        behavior: Unary,
        request: Any,
        context: aio.ServicerContext,
        details: grpc.HandlerCallDetails,
    ) -> Any:
        self._check(details)
        return await behavior(request, context)

    async def stream_enter(
        self, context: aio.ServicerContext, details: grpc.HandlerCallDetails
    ) -> None:
        self._check(details)


def server_interceptors(api_key: str | None) -> list[aio.ServerInterceptor]:
    """The public server's interceptors, outermost first."""
    interceptors: list[aio.ServerInterceptor] = [RequestIdInterceptor(), ErrorInterceptor()]
    if api_key:
        interceptors.append(AuthInterceptor(api_key))
    return interceptors
