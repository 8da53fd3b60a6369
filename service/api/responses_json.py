"""OpenAI Responses JSON <-> the domain (service.generation.responses): POST /v1/responses bodies
in; response objects and the semantic SSE events (`event: response.output_text.delta` ...) out,
as OpenAI writes them. Errors use OpenAI's error body (service.api.openai_json.error_body).

Input items become chat messages: a message item ({role, content}) one message, its
`input_image` parts images as chat's image_url parts are (same checks, same errors); consecutive
`function_call` items one assistant message with tool calls; a `function_call_output` a tool
message answering its call_id. Unknown fields are ignored, as OpenAI's chat route here does.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

from service.api.openai_json import (
    _bad,
    _integer,
    _number,
    _object,
    error_body,
)
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
from service.generation.responses import ResponsesRequest

JSON = "application/json"
EVENT_STREAM = "text/event-stream"
_MESSAGE_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_SKIPPED_ITEMS = ("reasoning",)  # earlier reasoning is not fed back to the model


def _dumps(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _hex_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


# --- requests ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decoded:
    """A decoded body: the domain request and the fields every response object echoes."""

    request: ResponsesRequest
    echo: dict[str, Any]
    stream: bool


def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                raise _bad(
                    f"{where}[{j}]",
                    f"{where}[{j}] must be a text part {{type: input_text, text}}; got type "
                    f"{kind!r} (only text input is supported)",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(where, f"{where} must be a string or a list of input_text parts")


def _message_parts(value: Any, where: str) -> list[str | ImageRef]:
    """A message item's content: a string, or text parts and `input_image` parts
    ({type: input_image, image_url: "data:..." | "https://..."}), the images named by their
    field (`input[0].content[1].image_url`)."""
    if not isinstance(value, list):
        return [_text(value, where)]
    parts: list[str | ImageRef] = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            if part.get("file_id") is not None:
                raise _bad(f"{where}[{j}].file_id", f"{where}[{j}]: file_id images are not "
                           "supported (this server keeps no files); send image_url")
            parts.append(image_url_ref(part.get("image_url"), f"{where}[{j}].image_url"))
        else:
            parts.append(_part_text(part, f"{where}[{j}]"))
    return parts


def _part_text(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
        raise _bad(where, f"{where} must be a text part {{type: input_text, text}} or an image "
                   f"{{type: input_image, image_url}}; got type {kind!r}")
    return str(part["text"])


def _input_messages(value: Any) -> tuple[ChatMessage, ...]:
    if isinstance(value, str):
        return (ChatMessage("user", value),)
    if not isinstance(value, list):
        raise _bad("input", "input is required: a string or a list of input items")
    messages: list[ChatMessage] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(where, f"{where} must be an object (a message or a function call item)")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise _bad(
                    f"{where}.role",
                    f"{where}.role must be one of {', '.join(_MESSAGE_ROLES)}; got {role!r}",
                )
            text, images = message_content(
                role, _message_parts(item.get("content"), f"{where}.content"), f"{where}.content")
            messages.append(ChatMessage(_MESSAGE_ROLES[role], text, images=images))
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            arguments = item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise _bad(where, f"{where}: a function_call needs string name and call_id")
            if not isinstance(arguments, str):
                raise _bad(f"{where}.arguments", f"{where}.arguments must be a JSON string")
            call = ToolCall(call_id, name, arguments)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and (last.tool_calls or not
                                                                   last.content):
                messages[-1] = replace(last, tool_calls=(*last.tool_calls, call))
            else:
                messages.append(ChatMessage("assistant", "", tool_calls=(call,)))
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise _bad(f"{where}.call_id", f"{where}.call_id must be a string")
            messages.append(ChatMessage("tool", _text(output, f"{where}.output"),
                                        tool_call_id=call_id))  # fmt: skip
        elif kind in _SKIPPED_ITEMS:
            continue
        else:
            raise _bad(
                f"{where}.type",
                f"{where}.type must be message, function_call, function_call_output or "
                f"reasoning; got {kind!r}",
            )
    return tuple(messages)


def _tools(value: Any) -> tuple[FunctionTool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _bad("tools", "tools must be a list of {type: function, name, parameters}")
    tools = []
    for i, tool in enumerate(value):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _bad(f"{at}.type", f"{at}.type must be 'function' (the only tool type "
                                     f"served); got {kind!r}")  # fmt: skip
        name = tool.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME_RE.match(name):
            raise _bad(f"{at}.name", f"{at}.name must be letters, digits, _ and - (at most 64); "
                                     f"got {name!r}")  # fmt: skip
        parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise _bad(f"{at}.parameters", f"{at}.parameters must be an object")
        description = tool.get("description")
        tools.append(FunctionTool(name, description if isinstance(description, str) else None,
                                  parameters, tool.get("strict") is True))  # fmt: skip
    if len({t.name for t in tools}) != len(tools):
        raise _bad("tools", "tools must have distinct names")
    return tuple(tools)


def _tool_choice(value: Any, tools: tuple[FunctionTool, ...]) -> ToolChoice | None:
    if value is None:
        return None
    if value in ("auto", "none", "required"):
        choice = ToolChoice(value)
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(
        value.get("name"), str
    ):
        choice = ToolChoice("function", value["name"])
    else:
        raise _bad("tool_choice", "tool_choice must be 'auto', 'none', 'required' or "
                                  f"{{type: function, name}}; got {value!r}")  # fmt: skip
    if choice.mode in ("required", "function") and not tools:
        raise _bad("tool_choice", f"tool_choice {value!r} needs tools")
    if choice.mode == "function" and choice.function not in {t.name for t in tools}:
        raise _bad("tool_choice", f"tool_choice names {choice.function!r}, which is not in tools")
    return choice


def _format(text: Any) -> ResponseFormat | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("text", "text must be an object {format: {...}}")
    spec = text.get("format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind in ("text", "json_object"):
        return ResponseFormat(kind)
    if kind != "json_schema":
        raise _bad("text.format.type", "text.format.type must be text, json_object or "
                                       f"json_schema; got {kind!r}")  # fmt: skip
    name, schema = spec.get("name"), spec.get("schema")
    if not isinstance(name, str) or not FUNCTION_NAME_RE.match(name):
        raise _bad("text.format.name", "text.format.name must be letters, digits, _ and - "
                                       f"(at most 64); got {name!r}")  # fmt: skip
    if not isinstance(schema, dict):
        raise _bad("text.format.schema", "text.format.schema must be a JSON schema object")
    return ResponseFormat("json_schema", schema, spec.get("strict") is True)


def _optional_string(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _bad(name, f"{name} must be a string; got {value!r}")
    return value


def create_request(data: bytes) -> Decoded:
    """Decodes a POST /v1/responses body; raises ValidationError naming the field."""
    body = _object(data)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "model is required (a string: the served model id, or 'tgi')")
    max_tokens = _integer(body, "max_output_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise _bad("max_output_tokens", f"max_output_tokens must be >= 1; got {max_tokens}")
    stream, store = body.get("stream", False), body.get("store", True)
    for name, value in (("stream", stream), ("store", store)):
        if value is not None and not isinstance(value, bool):
            raise _bad(name, f"{name} must be a boolean; got {value!r}")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _bad("metadata", "metadata must be an object of string values")
    instructions = _optional_string(body, "instructions")
    previous = _optional_string(body, "previous_response_id")
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    params = SamplingRequest(
        model=model,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"),
        stream=stream is True,
        include_usage=stream is True,  # the final event carries usage
    )
    chat = ChatRequest(
        _input_messages(body.get("input")),
        params,
        response_format=_format(body.get("text")),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel is not False,
    )
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_tokens,
        "metadata": metadata or {},
        "parallel_tool_calls": parallel is not False,
        "previous_response_id": previous,
        "store": store is not False,
        "temperature": params.temperature if params.temperature is not None else 1.0,
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": params.top_p if params.top_p is not None else 1.0,
        "truncation": "disabled",
        "user": _optional_string(body, "user"),
    }
    request = ResponsesRequest(chat, instructions, previous, store is not False)
    return Decoded(request, echo, stream is True)


# --- response objects ----------------------------------------------------------------------


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": content if status == "completed" else []}  # fmt: skip


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": content if status == "completed" else []}  # fmt: skip


def _call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "id": "fc_" + call.id.removeprefix("call_"),
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status == "completed" else "",
    }


def _response(
    response_id: str,
    created_at: int,
    model: str,
    echo: dict[str, Any],
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: Usage | None,
    finish_reason: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "incomplete" if incomplete and status == "completed" else status,
        "error": error,
        "incomplete_details": incomplete,
        "model": model,
        "output": output,
        "reasoning": {"effort": None, "summary": None},
        "usage": None if usage is None else _usage(usage),
        **echo,
    }


def output_items(choice: Choice) -> list[dict[str, Any]]:
    """The output items of a finished choice: its reasoning, its message, then its calls."""
    items = []
    if choice.reasoning is not None:
        items.append(_reasoning_item(_hex_id("rs_"), choice.reasoning))
    if choice.text or not choice.tool_calls:
        items.append(_message_item(_hex_id("msg_"), choice.text))
    items += [_call_item(c) for c in choice.tool_calls]
    return items


def response_body(response_id: str, echo: dict[str, Any], completed: Completed) -> dict[str, Any]:
    """The response object of a finished (unary) request."""
    choice = completed.choices[0]
    return _response(
        response_id, completed.header.created, completed.header.model, echo,
        status="completed", output=output_items(choice), usage=completed.usage,
        finish_reason=choice.finish_reason,
    )  # fmt: skip


def encode(body: dict[str, Any]) -> bytes:
    return _dumps(body)


def deleted_body(response_id: str) -> bytes:
    return _dumps({"id": response_id, "object": "response.deleted", "deleted": True})


def not_found_body(response_id: str) -> tuple[int, bytes]:
    body = {"error": {"message": f"No response with id {response_id!r} is stored here (never "
                                 "stored, store: false, deleted, expired or evicted)",
                      "type": "invalid_request_error", "param": "response_id",
                      "code": "not_found"}}  # fmt: skip
    return 404, _dumps(body)


# --- streams -------------------------------------------------------------------------------


@dataclass
class _OpenItem:
    """The output item being streamed: its position, id, kind ("reasoning", "message" or
    "function_call") and what it has so far (text, or a call's name, call_id and arguments)."""

    index: int
    item_id: str
    kind: str
    text: list[str] = field(default_factory=list)
    call: ToolCall | None = None


@dataclass
class EventWriter:
    """The semantic event sequence of one streamed response: response.created,
    response.in_progress, then per output item (reasoning, message, function_call) its
    output_item.added, its deltas (reasoning_text / output_text / function_call_arguments), its
    .done events and output_item.done; finally response.completed (or .incomplete / .failed).
    Every event carries `sequence_number` from 0. Tool-call arguments go out as generated."""

    response_id: str
    model: str
    echo: dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""  # all output text, for the stored conversation
    calls: list[ToolCall] = field(default_factory=list)  # finished calls, in order
    final: dict[str, Any] | None = None  # the response object, once finished
    _sequence: int = 0
    _open: _OpenItem | None = None
    _finish_reason: str | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _dumps(data) + b"\n\n"

    def _snapshot(self, status: str, **kw: Any) -> dict[str, Any]:
        return _response(self.response_id, self.created_at, self.model, self.echo,
                         status=status, output=list(self.output), **kw)  # fmt: skip

    def start(self) -> bytes:
        snapshot = self._snapshot("in_progress", usage=None)
        return self._event("response.created", response=snapshot) + self._event(
            "response.in_progress", response=snapshot
        )

    def _begin(self, kind: str, call: ToolCall | None = None) -> bytes:
        """Closes the open item and opens a new one of `kind`."""
        out = self._close()
        index = len(self.output)
        if kind == "function_call":
            assert call is not None
            item = _call_item(call, "in_progress")
            self._open = _OpenItem(index, item["id"], kind, call=call)
            self.output.append(item)
            return out + self._event("response.output_item.added", output_index=index, item=item)
        prefix, part = ("rs_", "reasoning_text") if kind == "reasoning" else ("msg_", "output_text")
        self._open = _OpenItem(index, _hex_id(prefix), kind)
        item = (_reasoning_item(self._open.item_id, "", "in_progress") if kind == "reasoning"
                else _message_item(self._open.item_id, "", "in_progress"))  # fmt: skip
        self.output.append(item)
        empty = {"type": part, "text": ""} | ({"annotations": [], "logprobs": []}
                                               if part == "output_text" else {})  # fmt: skip
        return out + self._event(
            "response.output_item.added", output_index=index, item=item
        ) + self._event("response.content_part.added", item_id=self._open.item_id,
                        output_index=index, content_index=0, part=empty)  # fmt: skip

    def _close(self) -> bytes:
        item, self._open = self._open, None
        if item is None:
            return b""
        at = {"item_id": item.item_id, "output_index": item.index}
        if item.kind == "function_call":
            assert item.call is not None
            call = replace(item.call, arguments="".join(item.text))
            self.calls.append(call)
            done = _call_item(call)
            self.output[item.index] = done
            return self._event("response.function_call_arguments.done", name=call.name,
                               arguments=call.arguments, **at) + self._event(
                "response.output_item.done", output_index=item.index, item=done)  # fmt: skip
        text = "".join(item.text)
        if item.kind == "reasoning":
            done = _reasoning_item(item.item_id, text)
            kind, extra = "response.reasoning_text.done", {}
        else:
            done = _message_item(item.item_id, text)
            kind, extra = "response.output_text.done", {"logprobs": []}
        self.output[item.index] = done
        return (
            self._event(kind, content_index=0, text=text, **extra, **at)
            + self._event("response.content_part.done", content_index=0,
                          part=done["content"][0], **at)
            + self._event("response.output_item.done", output_index=item.index, item=done)
        )  # fmt: skip

    def _text(self, kind: str, text: str) -> bytes:
        out = b"" if self._open is not None and self._open.kind == kind else self._begin(kind)
        item = self._open
        assert item is not None
        item.text.append(text)
        event = "response.reasoning_text.delta" if kind == "reasoning" else (
            "response.output_text.delta")  # fmt: skip
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + self._event(event, item_id=item.item_id, output_index=item.index,
                                 content_index=0, delta=text, **extra)  # fmt: skip

    def push(self, event: StreamEvent) -> bytes:
        """The events for one engine event (empty bytes when it adds nothing)."""
        if isinstance(event, UsageChunk):
            return self._finish(event.usage)
        assert isinstance(event, ChoiceDelta)
        out = b""
        if event.reasoning:
            out += self._text("reasoning", event.reasoning)
        if event.text:
            self.text += event.text
            out += self._text("message", event.text)
        for chunk in event.tool_calls:
            if chunk.id is not None:  # a new call: id and name first
                out += self._begin("function_call", ToolCall(chunk.id, chunk.name or "", ""))
            item = self._open
            if chunk.arguments and item is not None and item.kind == "function_call":
                item.text.append(chunk.arguments)
                out += self._event("response.function_call_arguments.delta",
                                   item_id=item.item_id, output_index=item.index,
                                   delta=chunk.arguments)  # fmt: skip
        if event.finish_reason is not None:
            self._finish_reason = event.finish_reason
        return out

    def _finish(self, usage: Usage) -> bytes:
        out = b""
        if not self.output:  # nothing generated: an empty message, as OpenAI answers
            out += self._begin("message")
        out += self._close()
        final = self._snapshot("completed", usage=usage, finish_reason=self._finish_reason)
        self.final = final
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return out + self._event(kind, response=final)

    def failed(self, error: BaseException) -> bytes:
        """After events were sent: an `error` event, then response.failed."""
        _, body = error_body(error)
        detail = json.loads(body)["error"]
        failed = self._snapshot("failed", usage=None,
                                error={"code": detail["code"] or "server_error",
                                       "message": detail["message"]})  # fmt: skip
        return self._event("error", code=detail["code"], message=detail["message"],
                           param=detail["param"]) + self._event("response.failed",
                                                                response=failed)  # fmt: skip
