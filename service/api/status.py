"""Errors of the public API's domain and the one table that maps them to gRPC status codes.

Domain code raises these (or the engine's `EngineError`s); only `service.api.interceptors` turns them
into a status, and the servicer uses `classify` for the in-band `error_type` of a failed stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from service.engine.contracts import (
    DeadlineExceededError,
    DrainingError,
    EngineError,
    OverloadedError,
    ShardUnavailableError,
)


class ValidationError(EngineError):
    """A request parameter is invalid (INVALID_ARGUMENT). The message names the field, the value
    and the limit, e.g. "parameters.top_p must be in (0, 1]; got 1.5"."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class UnsupportedError(EngineError):
    """A well-formed request asks for something this server does not do (UNIMPLEMENTED)."""


class UnauthenticatedError(EngineError):
    """The call lacks the API key the server requires (UNAUTHENTICATED)."""


class GenerationError(EngineError):
    """The engine failed a request for a reason other than the specific ones (INTERNAL)."""


@dataclass(frozen=True)
class ErrorKind:
    """How one error is reported: the gRPC status, the in-band `error_type` of streams and the
    `reason` label of the failure metric."""

    code: grpc.StatusCode
    error_type: str


# Most specific first: subclasses must come before their bases.
_KINDS: tuple[tuple[type[BaseException], ErrorKind], ...] = (
    (ValidationError, ErrorKind(grpc.StatusCode.INVALID_ARGUMENT, "validation")),
    (UnsupportedError, ErrorKind(grpc.StatusCode.UNIMPLEMENTED, "validation")),
    (UnauthenticatedError, ErrorKind(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated")),
    (OverloadedError, ErrorKind(grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded")),
    (DrainingError, ErrorKind(grpc.StatusCode.UNAVAILABLE, "unavailable")),
    (ShardUnavailableError, ErrorKind(grpc.StatusCode.UNAVAILABLE, "unavailable")),
    (DeadlineExceededError, ErrorKind(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline")),
    (EngineError, ErrorKind(grpc.StatusCode.INTERNAL, "generation")),
)
_UNEXPECTED = ErrorKind(grpc.StatusCode.INTERNAL, "generation")


def classify(error: BaseException) -> ErrorKind:
    """Returns how `error` is reported; anything unknown is an INTERNAL "generation" error."""
    for error_class, kind in _KINDS:
        if isinstance(error, error_class):
            return kind
    return _UNEXPECTED


def is_domain_error(error: BaseException) -> bool:
    """True for errors whose message is meant for clients (unexpected ones are not echoed)."""
    return isinstance(error, EngineError)


def public_message(error: BaseException) -> str:
    """The message clients see: the domain error's own, or a generic one for bugs."""
    if is_domain_error(error):
        return str(error) or type(error).__name__
    return f"internal error ({type(error).__name__}); see the router log"
