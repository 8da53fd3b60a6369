"""Typed exceptions for the gRPC statuses (and in-band stream errors) of the tokenwire API.

Both clients raise only these: `grpc.RpcError` (sync) and `grpclib.GRPCError` (async) never leak
out, so callers handle one hierarchy whichever client they use.
"""

from __future__ import annotations


class TokenwireError(Exception):
    """Base class of every error the SDK raises for a failed call.

    `code` is the gRPC status name (e.g. "INVALID_ARGUMENT"); `message` is the server's message.
    """

    code: str = "UNKNOWN"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.message}" if self.message else self.code


class ValidationError(TokenwireError, ValueError):
    """The request is invalid (INVALID_ARGUMENT); the message names the field and the limit."""

    code = "INVALID_ARGUMENT"


class UnsupportedError(ValidationError):
    """The request asks for something this server does not do (UNIMPLEMENTED)."""

    code = "UNIMPLEMENTED"


class OverloadedError(TokenwireError):
    """The server is over capacity (RESOURCE_EXHAUSTED): retry later."""

    code = "RESOURCE_EXHAUSTED"


class UnauthenticatedError(TokenwireError):
    """The call lacks the API key the server requires, or the key is wrong (UNAUTHENTICATED)."""

    code = "UNAUTHENTICATED"


class NotFoundError(TokenwireError, LookupError):
    """The named thing is not there (a stored Response, a model; gRPC NOT_FOUND)."""

    code = "NOT_FOUND"


class PermissionDeniedError(TokenwireError):
    """The API key is not allowed to make this call (PERMISSION_DENIED)."""

    code = "PERMISSION_DENIED"


class UnavailableError(TokenwireError):
    """The server cannot be reached or cannot generate right now (UNAVAILABLE)."""

    code = "UNAVAILABLE"


class DeadlineExceededError(TokenwireError, TimeoutError):
    """The call's deadline passed before it finished (DEADLINE_EXCEEDED)."""

    code = "DEADLINE_EXCEEDED"


class CancelledError(TokenwireError):
    """The call was cancelled (CANCELLED)."""

    code = "CANCELLED"


class GenerationError(TokenwireError):
    """The model server failed while generating (INTERNAL, or an in-band "generation" error)."""

    code = "INTERNAL"


# gRPC status name -> exception class. Statuses not listed become a plain TokenwireError.
_BY_STATUS: dict[str, type[TokenwireError]] = {
    "INVALID_ARGUMENT": ValidationError,
    "OUT_OF_RANGE": ValidationError,
    "FAILED_PRECONDITION": ValidationError,
    "UNIMPLEMENTED": UnsupportedError,
    "RESOURCE_EXHAUSTED": OverloadedError,
    "UNAUTHENTICATED": UnauthenticatedError,
    "PERMISSION_DENIED": PermissionDeniedError,
    "NOT_FOUND": NotFoundError,
    "UNAVAILABLE": UnavailableError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "CANCELLED": CancelledError,
    "INTERNAL": GenerationError,
}

# In-band `error_type` of a failed stream (see GenerateStreamResponse) -> exception class.
_BY_ERROR_TYPE: dict[str, type[TokenwireError]] = {
    "validation": ValidationError,
    "overloaded": OverloadedError,
    "unauthenticated": UnauthenticatedError,
    "unavailable": UnavailableError,
    "deadline": DeadlineExceededError,
    "generation": GenerationError,
}


def error_for_status(code: str, message: str) -> TokenwireError:
    """Builds the exception for a gRPC status name (e.g. "UNAVAILABLE") and message."""
    cls = _BY_STATUS.get(code)
    if cls is None:
        return TokenwireError(message, code=code)
    return cls(message)


def error_for_event(error_type: str | None, message: str) -> TokenwireError:
    """Builds the exception for an in-band stream error (`error_type`, `error`)."""
    cls = _BY_ERROR_TYPE.get(error_type or "", GenerationError)
    return cls(message)
