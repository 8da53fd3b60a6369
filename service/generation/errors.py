"""Errors of the public API's domain, and the one table of their kinds (`error_type`): the
in-band `error_type` of a failed stream and the `reason` label of the failure metric.

Domain code raises these (or the engine's `EngineError`s); `service.api.status` maps each to a
gRPC status code, and only `service.api.interceptors` turns them into a status.
"""

from __future__ import annotations

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


class ValidationError(EngineError):
    """A request parameter is invalid (INVALID_ARGUMENT). The message names the field, the value
    and the limit, e.g. "parameters.top_p must be in (0, 1]; got 1.5"."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class UnsupportedError(EngineError):
    """A well-formed request asks for something this server does not do (UNIMPLEMENTED)."""


class ModelNotFoundError(EngineError):
    """The request names a model this server does not serve (NOT_FOUND)."""


class UnauthenticatedError(EngineError):
    """The call lacks the API key the server requires (UNAUTHENTICATED)."""


class GenerationError(EngineError):
    """The engine failed a request for a reason other than the specific ones (INTERNAL)."""


# Most specific first: subclasses must come before their bases.
_ERROR_TYPES: tuple[tuple[type[BaseException], str], ...] = (
    (ValidationError, "validation"),
    (UnsupportedError, "validation"),
    (UnauthenticatedError, "unauthenticated"),
    (ModelNotFoundError, "not_found"),
    (AdapterNotFoundError, "not_found"),
    (AdapterLoadError, "validation"),
    (AdapterExistsError, "validation"),
    (AdaptersDisabledError, "validation"),
    (OverloadedError, "overloaded"),
    (DrainingError, "unavailable"),
    (ShardUnavailableError, "unavailable"),
    (DeadlineExceededError, "deadline"),
    (EngineError, "generation"),
)


def error_type(error: BaseException) -> str:
    """The kind of `error` as clients and metrics see it; anything unknown is "generation"."""
    for error_class, kind in _ERROR_TYPES:
        if isinstance(error, error_class):
            return kind
    return "generation"
