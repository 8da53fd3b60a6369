"""The OpenAI Responses and Anthropic Messages RPCs (tokenwire.v1.ResponsesService,
tokenwire.v1.AnthropicService) carry each API's exact JSON and SSE bytes in `google.api.HttpBody`:
this module turns request mappings into bodies, replies into dicts (one JSON object, or one dict
per SSE event) and error bodies into the SDK's exceptions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any

from ._errors import (
    DeadlineExceededError,
    GenerationError,
    NotFoundError,
    OverloadedError,
    TokenwireError,
    UnauthenticatedError,
    UnavailableError,
    ValidationError,
)
from ._generated.google.api import HttpBody

# OpenAI error `code` / Anthropic error `type` -> exception class (OpenAI `type`s as fallback).
_BY_KIND: dict[str, type[TokenwireError]] = {
    "invalid_request_error": ValidationError,
    "invalid_api_key": UnauthenticatedError,
    "authentication_error": UnauthenticatedError,
    "not_found": NotFoundError,
    "model_not_found": NotFoundError,
    "not_found_error": NotFoundError,
    "rate_limit_exceeded": OverloadedError,
    "rate_limit_error": OverloadedError,
    "service_unavailable": UnavailableError,
    "overloaded_error": UnavailableError,
    "timeout": DeadlineExceededError,
}


def request_body(body: Mapping[str, Any], *, stream: bool | None = None) -> HttpBody:
    """The HttpBody of a JSON request (`stream` set when given)."""
    fields = dict(body)
    if stream is not None:
        fields["stream"] = stream
    return HttpBody(content_type="application/json", data=json.dumps(fields).encode())


def error_of(reply: Mapping[str, Any]) -> TokenwireError | None:
    """The exception an OpenAI or Anthropic error object stands for (None: not an error)."""
    error = reply.get("error")
    if not isinstance(error, Mapping):  # an OpenAI stream's `error` event is flat
        if reply.get("type") != "error" or "message" not in reply:
            return None
        error = reply
    message = str(error.get("message") or "error")
    for key in (error.get("code"), error.get("type")):
        cls = _BY_KIND.get(key) if isinstance(key, str) else None
        if cls is not None:
            return cls(message)
    return GenerationError(message)


def _json(data: bytes) -> dict[str, Any]:
    reply = json.loads(data)
    error = error_of(reply)
    if error is not None:
        raise error
    return reply


def json_reply(chunks: Iterable[HttpBody]) -> dict[str, Any]:
    """The one JSON object of a non-stream answer; raises for an error body."""
    return _json(b"".join(chunk.data for chunk in chunks))


async def json_reply_async(chunks: AsyncIterator[HttpBody]) -> dict[str, Any]:
    return _json(b"".join([chunk.data async for chunk in chunks]))


class _SseParser:
    """Splits SSE bytes into the JSON of each `data:` line (events may span chunks)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: HttpBody) -> list[dict[str, Any]]:
        if chunk.content_type.startswith("application/json"):  # an error before any event
            _json(chunk.data)
        self._buffer += chunk.data
        *blocks, self._buffer = self._buffer.split(b"\n\n")
        events = []
        for block in blocks:
            for line in block.split(b"\n"):
                if line.startswith(b"data: ") and line[6:] != b"[DONE]":
                    event = json.loads(line[6:])
                    error = error_of(event)
                    if error is not None:
                        raise error
                    events.append(event)
        return events


def sse_events(chunks: Iterable[HttpBody]) -> Iterator[dict[str, Any]]:
    """The events of a streamed answer, each a dict with its `type`; an in-band error raises."""
    parser = _SseParser()
    for chunk in chunks:
        yield from parser.feed(chunk)


async def sse_events_async(chunks: AsyncIterator[HttpBody]) -> AsyncIterator[dict[str, Any]]:
    parser = _SseParser()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            yield event
