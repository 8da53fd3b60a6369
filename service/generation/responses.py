"""OpenAI's Responses API as the router runs it: a Responses request is a chat request (same
engine path: chat template, grammar, LoRA via `model`, cancellation, metrics) whose conversation
may continue a stored earlier response (`previous_response_id`).

No JSON and no protobuf here: `service.api.responses_json` decodes bodies into
`ResponsesRequest` and encodes what `ResponsesEndpoints` returns.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from service.generation.errors import ValidationError
from service.generation.openai import (
    ChatMessage,
    ChatRequest,
    Choice,
    Completed,
    OpenAIEndpoints,
    ResponseHeader,
    StreamEvent,
)
from service.generation.response_store import ResponseStore

RESPONSES = "responses"  # metrics label of the route (unary)
RESPONSES_STREAM = "responses_stream"


@dataclass(frozen=True)
class ResponsesRequest:
    """A decoded POST /v1/responses. `chat.messages` holds only this request's input items
    (as chat messages, without the instructions)."""

    chat: ChatRequest
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True


@dataclass(frozen=True)
class StoredResponse:
    """What a stored response keeps: the conversation up to and including its output (without
    instructions, which OpenAI does not carry over), and the response object as sent (opaque
    here: the API layer's encoding, returned by GET)."""

    messages: tuple[ChatMessage, ...]
    body: Any


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(16)


def output_message(choice: Choice) -> ChatMessage:
    """The assistant message a finished choice adds to the conversation."""
    return ChatMessage("assistant", choice.text, tool_calls=choice.tool_calls)


class ResponsesEndpoints:
    """POST / GET / DELETE /v1/responses on the chat completions endpoints and a store."""

    def __init__(self, chat: OpenAIEndpoints, store: ResponseStore[StoredResponse]) -> None:
        self.chat = chat
        self.store = store

    def conversation(self, request: ResponsesRequest) -> tuple[ChatMessage, ...]:
        """The earlier turns (from previous_response_id) and this request's input."""
        earlier: tuple[ChatMessage, ...] = ()
        if request.previous_response_id is not None:
            stored = self.store.get(request.previous_response_id)
            if stored is None:
                raise ValidationError(
                    "previous_response_id",
                    f"previous_response_id {request.previous_response_id!r} is not stored here "
                    f"(never stored, store: false, deleted, older than --responses-store-ttl "
                    f"({self.store.ttl_seconds:g} s) or evicted: --responses-store-size "
                    f"{self.store.max_entries})",
                )
            earlier = stored.messages
        return earlier + request.chat.messages

    def chat_request(
        self, request: ResponsesRequest, conversation: tuple[ChatMessage, ...]
    ) -> ChatRequest:
        """The chat request that runs: instructions as the system message, then the
        conversation (`conversation(request)`)."""
        messages = conversation
        if request.instructions:
            messages = (ChatMessage("system", request.instructions), *messages)
        if not conversation:
            raise ValidationError("input", "input must not be empty")
        return replace(request.chat, messages=messages)

    async def create(
        self, chat: ChatRequest, *, request_id: str, deadline: float | None
    ) -> Completed:
        return await self.chat.chat(
            chat, request_id=request_id, deadline=deadline, method=RESPONSES
        )

    async def create_stream(
        self, chat: ChatRequest, *, request_id: str, deadline: float | None
    ) -> tuple[ResponseHeader, AsyncIterator[StreamEvent]]:
        return await self.chat.chat_stream(
            chat, request_id=request_id, deadline=deadline, method=RESPONSES_STREAM
        )

    def remember(
        self,
        response_id: str,
        request: ResponsesRequest,
        conversation: tuple[ChatMessage, ...],
        output: ChatMessage,
        body: Any,
    ) -> None:
        """Stores a finished response (unless the request said store: false)."""
        if request.store:
            self.store.put(response_id, StoredResponse((*conversation, output), body))

    def get(self, response_id: str) -> StoredResponse | None:
        return self.store.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)
