"""Domain errors -> gRPC status codes: the one table, used by the interceptor (status) and the
servicer (the in-band `error_type` of a failed stream)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from service.engine.adapters import (
    AdapterExistsError,
    AdapterLoadError,
    AdapterNotFoundError,
    AdaptersDisabledError,
)
from service.engine.contracts import (
    DeadlineExceededError,
    DrainingError,
    EngineError,
    OverloadedError,
    ShardUnavailableError,
)
from service.generation.errors import (
    ModelNotFoundError,
    UnauthenticatedError,
    UnsupportedError,
    ValidationError,
    error_type,
)
from service.generation.images.refs import ImageTooLargeError


@dataclass(frozen=True)
class ErrorKind:
    """How one error is reported: the gRPC status, the in-band `error_type` of streams and the
    `reason` label of the failure metric."""

    code: grpc.StatusCode
    error_type: str


# Most specific first: subclasses must come before their bases.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    # An image over --max-image-bytes: OUT_OF_RANGE, which the REST faces answer with 413.
    (ImageTooLargeError, grpc.StatusCode.OUT_OF_RANGE),
    (ValidationError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnsupportedError, grpc.StatusCode.UNIMPLEMENTED),
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (ModelNotFoundError, grpc.StatusCode.NOT_FOUND),
    (AdapterNotFoundError, grpc.StatusCode.NOT_FOUND),
    (AdapterLoadError, grpc.StatusCode.INVALID_ARGUMENT),
    (AdapterExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (AdaptersDisabledError, grpc.StatusCode.FAILED_PRECONDITION),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DrainingError, grpc.StatusCode.UNAVAILABLE),
    (ShardUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (EngineError, grpc.StatusCode.INTERNAL),
)


def classify(error: BaseException) -> ErrorKind:
    """Returns how `error` is reported; anything unknown is an INTERNAL "generation" error."""
    for error_class, code in _CODES:
        if isinstance(error, error_class):
            return ErrorKind(code, error_type(error))
    return ErrorKind(grpc.StatusCode.INTERNAL, error_type(error))


def is_domain_error(error: BaseException) -> bool:
    """True for errors whose message is meant for clients (unexpected ones are not echoed)."""
    return isinstance(error, EngineError)


def public_message(error: BaseException) -> str:
    """The message clients see: the domain error's own, or a generic one for bugs."""
    if is_domain_error(error):
        return str(error) or type(error).__name__
    return f"internal error ({type(error).__name__}); see the router log"
