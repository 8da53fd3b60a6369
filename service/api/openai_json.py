"""OpenAI's JSON <-> the OpenAI domain objects (service.generation.openai): request bodies in,
response bodies, SSE chunks and error bodies out, byte for byte as OpenAI writes them (`null`
where OpenAI writes null, integers as numbers, `data: [DONE]` at the end of a stream).

Request decoding follows OpenAI: unknown fields are ignored; a field that names a feature this
server lacks (the deprecated functions / function_call, logit_bias, content parts other than text
and image_url) is a ValidationError naming it, never silently dropped. Image parts (data or
http(s) URLs) go to the model's image pipeline (service.generation.images). response_format
(json_object, json_schema) and tools (tool_choice, parallel_tool_calls) constrain the output
with a grammar.
"""

from __future__ import annotations

import json
from typing import Any

import grpc

from service.api.status import classify, public_message
from service.generation.errors import ModelNotFoundError, ValidationError
from service.generation.grammar import FUNCTION_NAME_RE, FunctionTool
from service.generation.images.refs import ImageRef
from service.generation.openai import (
    ChatMessage,
    ChatRequest,
    Choice,
    Completed,
    CompletionRequest,
    ResponseFormat,
    ResponseHeader,
    SamplingRequest,
    StreamEvent,
    TokenLogprob,
    ToolCall,
    ToolCallChunk,
    ToolChoice,
    Usage,
    UsageChunk,
    image_url_ref,
    message_content,
)

JSON = "application/json"
EVENT_STREAM = "text/event-stream"
DONE = b"data: [DONE]\n\n"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20
# Fields that ask for something this server does not do (OpenAI's names).
UNSUPPORTED = (
    "functions",
    "function_call",
    "audio",
    "prediction",
    "web_search_options",
)
# gRPC status of a domain error -> HTTP status, OpenAI error type and code.
_HTTP: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.OUT_OF_RANGE: (413, "invalid_request_error", "payload_too_large"),
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.UNIMPLEMENTED: (400, "invalid_request_error", "unsupported"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}


def _dumps(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


# --- requests ------------------------------------------------------------------------------


def _bad(param: str, message: str) -> ValidationError:
    return ValidationError(param, message)


def _object(data: bytes) -> dict[str, Any]:
    try:
        body = json.loads(data or b"null")
    except ValueError as error:
        raise _bad("body", f"the request body is not valid JSON ({error})") from None
    if not isinstance(body, dict):
        raise _bad("body", "the request body must be a JSON object")
    return body


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, f"{name} must be a number; got {value!r}")
    return float(value)


def _integer(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"{name} must be an integer; got {value!r}")
    return value


def _boolean(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, f"{name} must be a boolean; got {value!r}")
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise _bad("stop", f"stop must be a string or a list of strings; got {value!r}")


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name in UNSUPPORTED:
        if body.get(name) not in (None, [], "none"):
            raise _bad(name, f"{name} is not supported by this server")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "logit_bias is not supported by this server")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise _bad("modalities", f"only the text modality is supported; got {modalities!r}")


def _sampling(body: dict[str, Any]) -> SamplingRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "model is required (a string: the served model id, or 'tgi')")
    max_tokens = _integer(body, "max_completion_tokens")
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = _integer(body, "max_tokens"), "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise _bad(name, f"{name} must be >= 1; got {max_tokens}")
    n = _integer(body, "n")
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("stream_options", f"stream_options must be an object; got {options!r}")
        include_usage = _boolean(options, "include_usage")
    seed = _integer(body, "seed")
    if seed is not None and seed < 0:
        raise _bad("seed", f"seed must be >= 0; got {seed}")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("user", "user must be a string")
    return SamplingRequest(
        model=model,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"),
        seed=seed,
        stop=_stop(body),
        frequency_penalty=_number(body, "frequency_penalty"),
        presence_penalty=_number(body, "presence_penalty"),
        n=1 if n is None else n,
        stream=stream,
        include_usage=stream and include_usage,
    )


def _parts(value: Any, where: str) -> list[str | ImageRef]:
    """A message's content (a string or OpenAI's list of parts) as text and named images."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise _bad(f"{where}.content", f"{where}.content must be a string or a list of parts")
    parts: list[str | ImageRef] = []
    for j, part in enumerate(value):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            parts.append(image_url_ref(url, f"{at}.image_url"))
            continue
        if kind != "text":
            raise _bad(f"{at}.type", f"{at}: only text and image_url parts are supported; got "
                       f"type {kind!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise _bad(f"{at}.text", "a text part needs a string 'text'")
        parts.append(text)
    return parts


def _message(value: Any, i: int) -> ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(value, dict):
        raise _bad(where, f"{where} must be an object with 'role' and 'content'")
    role = value.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
    calls = _message_tool_calls(value.get("tool_calls"), where) if role == "assistant" else ()
    content = value.get("content")
    name, call_id = value.get("name"), value.get("tool_call_id")
    text, images = ("", ()) if content is None and calls else message_content(
        role, _parts(content, where), f"{where}.content")
    return ChatMessage(
        role="system" if role == "developer" else role,
        content=text,
        images=images,
        name=name if isinstance(name, str) else None,
        tool_call_id=call_id if isinstance(call_id, str) else None,
        tool_calls=calls,
    )


def _message_tool_calls(value: Any, where: str) -> tuple[ToolCall, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _bad(f"{where}.tool_calls", f"{where}.tool_calls must be a list")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(at, f"{at} must be {{id, type: function, function: {{name, arguments}}}}")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        call_id = call.get("id")
        calls.append(ToolCall(call_id if isinstance(call_id, str) else "", function["name"],
                              arguments))
    return tuple(calls)


def _response_format(body: dict[str, Any]) -> ResponseFormat | None:
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("text", "json_object"):
        return ResponseFormat(kind)
    if kind != "json_schema":
        raise _bad(
            "response_format",
            "response_format.type must be one of text, json_object, json_schema; got "
            f"{kind!r}",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format", "response_format.json_schema must be an object")
    name = spec.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME_RE.match(name):
        raise _bad(
            "response_format",
            "response_format.json_schema.name must be a string of letters, digits, _ and - "
            f"(at most 64); got {name!r}",
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise _bad("response_format", "response_format.json_schema.schema must be an object")
    strict = spec.get("strict") is True
    return ResponseFormat("json_schema", schema, strict)


def _tools(body: dict[str, Any]) -> tuple[FunctionTool, ...]:
    value = body.get("tools")
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _bad("tools", "tools must be a list of {type: function, function: {...}}")
    tools = []
    for i, tool in enumerate(value):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad(at, f"{at}.type must be 'function'")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _bad(at, f"{at}.function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME_RE.match(name):
            raise _bad(
                f"{at}.function.name",
                f"{at}.function.name must be letters, digits, _ and - (at most 64); got "
                f"{name!r}",
            )
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise _bad(f"{at}.function.parameters", f"{at}.function.parameters must be an object")
        description = function.get("description")
        tools.append(
            FunctionTool(
                name,
                description if isinstance(description, str) else None,
                parameters,
                function.get("strict") is True,
            )
        )
    if len({t.name for t in tools}) != len(tools):
        raise _bad("tools", "tools must have distinct function names")
    return tuple(tools)


def _tool_choice(body: dict[str, Any], tools: tuple[FunctionTool, ...]) -> ToolChoice | None:
    value = body.get("tool_choice")
    if value is None:
        return None
    if value in ("auto", "none", "required"):
        choice = ToolChoice(value)
    elif isinstance(value, dict) and isinstance(value.get("function"), dict):
        choice = ToolChoice("function", value["function"].get("name"))
    else:
        raise _bad(
            "tool_choice",
            "tool_choice must be 'auto', 'none', 'required' or {type: function, function: "
            f"{{name}}}}; got {value!r}",
        )
    if choice.mode in ("required", "function") and not tools:
        raise _bad("tool_choice", f"tool_choice {value!r} needs tools")
    if choice.mode == "function" and choice.function not in {t.name for t in tools}:
        raise _bad("tool_choice", f"tool_choice names {choice.function!r}, which is not in tools")
    return choice


def chat_request(data: bytes) -> ChatRequest:
    """Decodes a POST /v1/chat/completions body; raises ValidationError naming the field."""
    body = _object(data)
    _refuse_unsupported(body)
    params = _sampling(body)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _bad("messages", "messages is required (a list of {role, content} objects)")
    logprobs = _boolean(body, "logprobs")
    top_logprobs = _integer(body, "top_logprobs")
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise _bad(
            "top_logprobs", f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]; got {top_logprobs}"
        )
    params = SamplingRequest(
        **{**params.__dict__, "logprobs": logprobs, "top_logprobs": top_logprobs or None}
    )
    tools = _tools(body)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    return ChatRequest(
        tuple(_message(m, i) for i, m in enumerate(messages)),
        params,
        response_format=_response_format(body),
        tools=tools,
        tool_choice=_tool_choice(body, tools),
        parallel_tool_calls=parallel is not False,
    )


def completion_request(data: bytes) -> CompletionRequest:
    """Decodes a POST /v1/completions body (the prompt must be one string)."""
    body = _object(data)
    _refuse_unsupported(body)
    params = _sampling(body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise _bad("prompt", "prompt must be a string (token arrays and batches are not supported)")
    if body.get("logprobs") is not None:
        raise _bad("logprobs", "logprobs is not supported on /v1/completions by this server")
    if body.get("best_of") not in (None, 1):
        raise _bad("best_of", "best_of is not supported on /v1/completions (use n)")
    if body.get("suffix"):
        raise _bad("suffix", "suffix is not supported by this server")
    for name in ("tools", "tool_choice", "response_format"):
        if body.get(name) is not None:
            raise _bad(name, f"{name} is a chat completions parameter (/v1/chat/completions)")
    return CompletionRequest(prompt, params, echo=_boolean(body, "echo"))


# --- responses -----------------------------------------------------------------------------


def _usage(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def _token_bytes(text: str) -> list[int]:
    return list(text.encode())


def _logprobs(entries: tuple[TokenLogprob, ...] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": _token_bytes(e.token),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": _token_bytes(t)} for t, lp in e.top
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def _head(header: ResponseHeader, kind: str) -> dict[str, Any]:
    return {
        "id": header.id,
        "object": kind,
        "created": header.created,
        "model": header.model,
        "system_fingerprint": header.system_fingerprint,
    }


def _tool_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {} if index is None else {"index": index}
    body.update(
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
    )
    return body


def _tool_call_chunk(chunk: ToolCallChunk) -> dict[str, Any]:
    """A streamed piece of a call: id, type and name on its first piece only (the SDKs'
    accumulators join the arguments of the pieces that share an index)."""
    body: dict[str, Any] = {"index": chunk.index}
    function: dict[str, Any] = {}
    if chunk.id is not None:
        body.update(id=chunk.id, type="function")
    if chunk.name is not None:
        function["name"] = chunk.name
    function["arguments"] = chunk.arguments
    body["function"] = function
    return body


def _chat_choice(choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.text, "refusal": None}
    if choice.reasoning is not None:
        message["reasoning_content"] = choice.reasoning
    if choice.tool_calls:
        message["content"] = choice.text or None
        message["tool_calls"] = [_tool_call(c) for c in choice.tool_calls]
    return {
        "index": choice.index,
        "message": message,
        "logprobs": _logprobs(choice.logprobs),
        "finish_reason": choice.finish_reason,
    }


def chat_completion(completed: Completed) -> bytes:
    """A chat.completion object."""
    body = _head(completed.header, "chat.completion")
    body["choices"] = [_chat_choice(c) for c in completed.choices]
    body["usage"] = _usage(completed.usage)
    return _dumps(body)


def text_completion(completed: Completed) -> bytes:
    """A text_completion object."""
    body = _head(completed.header, "text_completion")
    body["choices"] = [
        {"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
        for c in completed.choices
    ]
    body["usage"] = _usage(completed.usage)
    return _dumps(body)


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + _dumps(body) + b"\n\n"


def chat_chunk(header: ResponseHeader, event: StreamEvent, include_usage: bool) -> bytes:
    """One `data:` event of a chat.completion.chunk stream."""
    body = _head(header, "chat.completion.chunk")
    if isinstance(event, UsageChunk):
        body["choices"], body["usage"] = [], _usage(event.usage)
        return _sse(body)
    delta: dict[str, Any] = {}
    if event.first:
        delta["role"] = "assistant"
    if event.first or event.text:
        delta["content"] = event.text
    if event.reasoning:
        delta["reasoning_content"] = event.reasoning
    if event.tool_calls:
        delta["tool_calls"] = [_tool_call_chunk(c) for c in event.tool_calls]
    body["choices"] = [
        {
            "index": event.index,
            "delta": delta,
            "logprobs": _logprobs(event.logprobs),
            "finish_reason": event.finish_reason,
        }
    ]
    if include_usage:
        body["usage"] = None
    return _sse(body)


def completion_chunk(header: ResponseHeader, event: StreamEvent, include_usage: bool) -> bytes:
    """One `data:` event of a text_completion stream."""
    body = _head(header, "text_completion")
    if isinstance(event, UsageChunk):
        body["choices"], body["usage"] = [], _usage(event.usage)
        return _sse(body)
    body["choices"] = [
        {
            "index": event.index,
            "text": event.text,
            "logprobs": None,
            "finish_reason": event.finish_reason,
        }
    ]
    if include_usage:
        body["usage"] = None
    return _sse(body)


# --- errors --------------------------------------------------------------------------------


def error_body(error: BaseException) -> tuple[int, bytes]:
    """OpenAI's error object for `error` and its HTTP status."""
    kind = classify(error)
    status, error_type, code = _HTTP.get(kind.code, (500, "server_error", None))
    param: str | None = None
    if isinstance(error, ValidationError):
        param = error.field
        if param in ("messages", "prompt") and "tokens" in str(error):
            code = "context_length_exceeded"
    elif isinstance(error, ModelNotFoundError):
        param = "model"
    body = {
        "error": {
            "message": public_message(error),
            "type": error_type,
            "param": param,
            "code": code,
        }
    }
    return status, _dumps(body)


def error_event(error: BaseException) -> bytes:
    """The in-band error event of a stream that already sent chunks (then [DONE] follows)."""
    return b"data: " + error_body(error)[1] + b"\n\n"
