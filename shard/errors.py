"""Domain errors of the shard; the servicer maps each class to one gRPC status code."""

from __future__ import annotations


class ShardError(Exception):
    """Base class; the message is what the caller sees."""


class InvalidRequestError(ShardError):
    """The router sent something inconsistent (missing blocks, unknown request, bad lengths)."""


class NotFoundError(ShardError):
    """An unknown batch id."""


class FailedPreconditionError(ShardError):
    """The call is not possible in the current state (no warmup yet, budget does not fit)."""


class FatalDeviceError(ShardError):
    """The device failed during a step; the shard's state is unknown and it must exit."""
