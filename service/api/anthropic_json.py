"""Anthropic Messages JSON <-> the chat domain (service.generation.openai): POST /v1/messages
and /v1/messages/count_tokens bodies in; message objects, the SSE event sequence
(message_start, content_block_start / _delta / _stop, message_delta, message_stop) and
Anthropic's error bodies `{"type": "error", "error": {"type", "message"}}` out.

Content blocks become chat messages: a user message's `tool_result` blocks become tool messages
(one per block, answering its tool_use_id), its text and image blocks one user message (an
image block's base64 or url source checked as chat's image_url parts are); an assistant
message's `tool_use` blocks become its tool calls. Unknown fields are ignored.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

import grpc

from service.api.openai_json import _bad, _integer, _number, _object
from service.api.status import classify, public_message
from service.generation.grammar import FUNCTION_NAME_RE, FunctionTool
from service.generation.images.refs import ImageRef
from service.generation.openai import (
    ChatMessage,
    ChatRequest,
    Choice,
    ChoiceDelta,
    Completed,
    ResponseFormat,
    SamplingRequest,
    StreamEvent,
    ToolCall,
    ToolChoice,
    Usage,
    UsageChunk,
    image_url_ref,
    message_content,
)

JSON = "application/json"
EVENT_STREAM = "text/event-stream"
TEMPERATURE_RANGE = (0.0, 1.0)  # Anthropic's range (the engine allows up to 2)
# gRPC status of a domain error -> HTTP status and Anthropic's error type.
_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.OUT_OF_RANGE: (413, "request_too_large"),
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNIMPLEMENTED: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "overloaded_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "api_error"),
}
# Finish reasons (OpenAI's, as the chat endpoints give them) -> Anthropic's stop_reason.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _dumps(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


# --- requests ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decoded:
    chat: ChatRequest
    stream: bool


def _text_blocks(value: Any, where: str) -> str:
    """A string, or a list of text blocks joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, block in enumerate(value):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind != "text" or not isinstance(block.get("text"), str):
                raise _bad(f"{where}[{j}]", f"{where}[{j}] must be a text block {{type: text, "
                                            f"text}}; got type {kind!r}")  # fmt: skip
            texts.append(block["text"])
        return "".join(texts)
    raise _bad(where, f"{where} must be a string or a list of text blocks")


def _message(value: Any, i: int) -> list[ChatMessage]:
    where = f"messages[{i}]"
    if not isinstance(value, dict):
        raise _bad(where, f"{where} must be an object with role and content")
    role = value.get("role")
    if role not in ("user", "assistant"):
        raise _bad(f"{where}.role", f"{where}.role must be 'user' or 'assistant'; got {role!r}")
    content = value.get("content")
    if isinstance(content, str):
        return [ChatMessage(role, content)]
    if not isinstance(content, list):
        raise _bad(f"{where}.content", f"{where}.content must be a string or a list of blocks")
    parts: list[str | ImageRef] = []
    calls: list[ToolCall] = []
    results: list[ChatMessage] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif kind == "image" and role == "user":
            parts.append(_image(block.get("source"), f"{at}.source"))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier thinking is not fed back to the model
        elif kind == "tool_use" and role == "assistant":
            name, call_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise _bad(at, f"{at}: a tool_use block needs string id and name")
            if not isinstance(arguments, dict):
                raise _bad(f"{at}.input", f"{at}.input must be an object")
            calls.append(ToolCall(call_id, name, json.dumps(arguments, ensure_ascii=False)))
        elif kind == "tool_result" and role == "user":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise _bad(f"{at}.tool_use_id", f"{at}.tool_use_id must be a string")
            output = block.get("content", "")
            results.append(ChatMessage("tool", _text_blocks(output, f"{at}.content"),
                                       tool_call_id=call_id))  # fmt: skip
        else:
            allowed = ("text, tool_use, thinking" if role == "assistant"
                       else "text, image, tool_result")
            raise _bad(f"{at}.type", f"{at}.type must be one of {allowed} in a {role} message; "
                                     f"got {kind!r}")  # fmt: skip
    messages = results
    if parts or calls or not results:
        text, images = message_content(role, parts, f"{where}.content")
        messages = [*results, ChatMessage(role, text, images=images, tool_calls=tuple(calls))]
    return messages


def _image(source: Any, where: str) -> ImageRef:
    """An image block's source: {type: base64, media_type, data} (read as the `data:` URL it
    spells, so that chat's image checks apply) or {type: url, url}."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "url":
        return image_url_ref(source.get("url"), where)
    if kind != "base64":
        raise _bad(f"{where}.type", f"{where}.type must be base64 or url; got {kind!r}")
    media, data = source.get("media_type"), source.get("data")
    if not isinstance(media, str) or not isinstance(data, str) or not data:
        raise _bad(where, f"{where}: a base64 source needs string media_type and data")
    return ImageRef(where, url=f"data:{media};base64,{data}")


def _tools(value: Any) -> tuple[FunctionTool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _bad("tools", "tools must be a list of {name, description, input_schema}")
    tools = []
    for i, tool in enumerate(value):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _bad(f"{at}.type", f"{at} must be a custom tool {{name, input_schema}}; "
                                     f"server tools are not supported (type {kind!r})")  # fmt: skip
        name = tool.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME_RE.match(name):
            raise _bad(f"{at}.name", f"{at}.name must be letters, digits, _ and - (at most 64); "
                                     f"got {name!r}")  # fmt: skip
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"{at}.input_schema", f"{at}.input_schema must be a JSON schema object")
        description = tool.get("description")
        tools.append(FunctionTool(name, description if isinstance(description, str) else None,
                                  schema, False))  # fmt: skip
    if len({t.name for t in tools}) != len(tools):
        raise _bad("tools", "tools must have distinct names")
    return tuple(tools)


def _tool_choice(value: Any, tools: tuple[FunctionTool, ...]) -> tuple[ToolChoice | None, bool]:
    """(the choice, parallel calls allowed)."""
    if value is None:
        return None, True
    kind = value.get("type") if isinstance(value, dict) else None
    modes = {"auto": "auto", "any": "required", "none": "none"}
    if kind in modes:
        choice = ToolChoice(modes[kind])
    elif kind == "tool" and isinstance(value.get("name"), str):
        choice = ToolChoice("function", value["name"])
    else:
        raise _bad("tool_choice", "tool_choice must be {type: auto | any | none} or {type: tool, "
                                  f"name}}; got {value!r}")  # fmt: skip
    if choice.mode in ("required", "function") and not tools:
        raise _bad("tool_choice", f"tool_choice {kind!r} needs tools")
    if choice.mode == "function" and choice.function not in {t.name for t in tools}:
        raise _bad("tool_choice.name",
                   f"tool_choice names {choice.function!r}, which is not in tools")  # fmt: skip
    parallel = value.get("disable_parallel_tool_use") is not True
    return choice, parallel


def _output_format(value: Any) -> ResponseFormat | None:
    """output_config.format (Anthropic's structured outputs): {type: json_schema, schema}."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("output_config", "output_config must be an object {format, effort}")
    spec = value.get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema":
        raise _bad("output_config.format.type", "output_config.format must be {type: "
                                                "json_schema, schema}")  # fmt: skip
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _bad("output_config.format.schema",
                   "output_config.format.schema must be a JSON schema object")  # fmt: skip
    return ResponseFormat("json_schema", schema, False)


def _common(body: dict[str, Any]) -> tuple[str, list[ChatMessage], tuple[FunctionTool, ...],
                                           ToolChoice | None, bool]:  # fmt: skip
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "model is required (a string: the served model id, or 'tgi')")
    messages_value = body.get("messages")
    if not isinstance(messages_value, list) or not messages_value:
        raise _bad("messages", "messages is required: a non-empty list of {role, content}")
    messages: list[ChatMessage] = []
    system = body.get("system")
    if system is not None:
        messages.append(ChatMessage("system", _text_blocks(system, "system")))
    for i, value in enumerate(messages_value):
        messages += _message(value, i)
    tools = _tools(body.get("tools"))
    choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    return model, messages, tools, choice, parallel


def messages_request(data: bytes) -> Decoded:
    """Decodes a POST /v1/messages body; raises ValidationError naming the field."""
    body = _object(data)
    model, messages, tools, choice, parallel = _common(body)
    max_tokens = _integer(body, "max_tokens")
    if max_tokens is None or max_tokens < 1:
        raise _bad("max_tokens", f"max_tokens is required: an integer >= 1; got {max_tokens!r}")
    temperature = _number(body, "temperature")
    low, high = TEMPERATURE_RANGE
    if temperature is not None and not low <= temperature <= high:
        raise _bad("temperature", f"temperature must be in [{low}, {high}]; got {temperature}")
    if body.get("top_k") is not None:
        raise _bad("top_k", "top_k is not supported by this server (use temperature or top_p)")
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list)
                                  and all(isinstance(s, str) and s for s in stops)):
        raise _bad("stop_sequences", "stop_sequences must be a list of non-empty strings")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", f"stream must be a boolean; got {stream!r}")
    params = SamplingRequest(
        model=model,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=_number(body, "top_p"),
        stop=tuple(stops or ()),
        stream=stream is True,
        include_usage=stream is True,
    )
    chat = ChatRequest(tuple(messages), params, tools=tools, tool_choice=choice,
                       parallel_tool_calls=parallel,
                       response_format=_output_format(body.get("output_config")))  # fmt: skip
    return Decoded(chat, stream is True)


def count_tokens_request(data: bytes) -> ChatRequest:
    """Decodes a POST /v1/messages/count_tokens body (no max_tokens)."""
    body = _object(data)
    model, messages, tools, choice, parallel = _common(body)
    return ChatRequest(tuple(messages), SamplingRequest(model=model), tools=tools,
                       tool_choice=choice, parallel_tool_calls=parallel)  # fmt: skip


# --- responses -----------------------------------------------------------------------------


def message_id(request_id: str) -> str:
    return "msg_" + secrets.token_hex(12)


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(call: ToolCall) -> Any:
    try:
        return json.loads(call.arguments)
    except ValueError:
        return {}


def _stop_reason(choice_reason: str, stop_sequence: str | None) -> str:
    return "stop_sequence" if stop_sequence is not None else STOP_REASONS[choice_reason]


def message_body(message: str, completed: Completed) -> bytes:
    """The message object of a finished (unary) request."""
    choice: Choice = completed.choices[0]
    content: list[dict[str, Any]] = []
    if choice.reasoning is not None:
        content.append({"type": "thinking", "thinking": choice.reasoning, "signature": ""})
    if choice.text or not choice.tool_calls:
        content.append({"type": "text", "text": choice.text})
    content += [{"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": _input(c)}
                for c in choice.tool_calls]  # fmt: skip
    return _dumps({
        "id": message,
        "type": "message",
        "role": "assistant",
        "model": completed.header.model,
        "content": content,
        "stop_reason": _stop_reason(choice.finish_reason, choice.stop_sequence),
        "stop_sequence": choice.stop_sequence,
        "usage": {"input_tokens": completed.usage.prompt_tokens,
                  "output_tokens": completed.usage.completion_tokens},
    })  # fmt: skip


def count_tokens_body(tokens: int) -> bytes:
    return _dumps({"input_tokens": tokens})


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _dumps({"type": kind, **data}) + b"\n\n"


@dataclass
class EventWriter:
    """Anthropic's event sequence of one streamed message: message_start; per content block
    (thinking, text, tool_use) content_block_start, its deltas (thinking_delta / text_delta /
    input_json_delta, the call's arguments as generated), content_block_stop; then
    message_delta (stop_reason, usage) and message_stop."""

    message: str
    model: str
    input_tokens: int
    _index: int = -1
    _open: str | None = None  # kind of the open block: "thinking" | "text" | "tool_use"
    _stop: tuple[str, str | None] | None = None  # (stop_reason, stop_sequence)
    finished: bool = False

    def start(self) -> bytes:
        return _event("message_start", {"message": {
            "id": self.message, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }})  # fmt: skip

    def _close(self) -> bytes:
        kind, self._open = self._open, None
        if kind is None:
            return b""
        out = b""
        if kind == "thinking":  # no signature: the thinking was not signed by this server
            out = self._delta({"type": "signature_delta", "signature": ""})
        return out + _event("content_block_stop", {"index": self._index})

    def _begin(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._index += 1
        self._open = kind
        return out + _event("content_block_start", {"index": self._index, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self._index, "delta": delta})

    def push(self, event: StreamEvent) -> bytes:
        if isinstance(event, UsageChunk):
            return self._finish(event.usage)
        assert isinstance(event, ChoiceDelta)
        out = b""
        if event.reasoning:
            if self._open != "thinking":
                out += self._begin("thinking", {"type": "thinking", "thinking": "",
                                                "signature": ""})  # fmt: skip
            out += self._delta({"type": "thinking_delta", "thinking": event.reasoning})
        if event.text:
            if self._open != "text":
                out += self._begin("text", {"type": "text", "text": ""})
            out += self._delta({"type": "text_delta", "text": event.text})
        for chunk in event.tool_calls:
            if chunk.id is not None:  # a new call: id and name first, then its arguments
                out += self._begin("tool_use", {"type": "tool_use", "id": _tool_id(chunk.id),
                                                "name": chunk.name or "", "input": {}})
            if chunk.arguments and self._open == "tool_use":
                out += self._delta({"type": "input_json_delta", "partial_json": chunk.arguments})
        if event.finish_reason is not None:
            self._stop = (_stop_reason(event.finish_reason, event.stop_sequence),
                          event.stop_sequence)  # fmt: skip
        return out

    def _finish(self, usage: Usage) -> bytes:
        out = b""
        if self._index < 0:  # nothing generated: one empty text block
            out += self._begin("text", {"type": "text", "text": ""})
        out += self._close()
        reason, sequence = self._stop or ("end_turn", None)
        self.finished = True
        return out + _event("message_delta", {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": usage.completion_tokens},
        }) + _event("message_stop", {})  # fmt: skip

    def failed(self, error: BaseException) -> bytes:
        """After events were sent: Anthropic's in-band `error` event."""
        return _event("error", {"error": _error(error)[1]})


# --- errors --------------------------------------------------------------------------------


def _error(error: BaseException) -> tuple[int, dict[str, str]]:
    status, kind = _HTTP.get(classify(error).code, (500, "api_error"))
    return status, {"type": kind, "message": public_message(error)}


def error_body(error: BaseException) -> tuple[int, bytes]:
    """Anthropic's error object for `error` and its HTTP status."""
    status, detail = _error(error)
    return status, _dumps({"type": "error", "error": detail})
