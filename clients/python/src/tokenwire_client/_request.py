"""Turns `generate(inputs, **parameters)` keyword arguments into the generated request message.

Shared by both clients so that they accept exactly the same parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ._generated.google.protobuf import Struct, Value
from ._generated.tokenwire.v1 import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    FunctionCall,
    FunctionDefinition,
    GenerateParameters,
    GenerateRequest,
    Grammar,
    JsonSchemaFormat,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolChoice,
)
from ._images import Prompt, content_parts, input_chunks

PARAMETER_NAMES: frozenset[str] = frozenset(f.name for f in dataclasses.fields(GenerateParameters))
# OpenAI-style parameters of chat / completion (the request fields but model and the prompt).
CHAT_PARAMETER_NAMES: frozenset[str] = frozenset(
    f.name for f in dataclasses.fields(ChatRequest)
) - {"model", "messages"}
COMPLETION_PARAMETER_NAMES: frozenset[str] = frozenset(
    f.name for f in dataclasses.fields(CompletionRequest)
) - {"model", "prompt"}


def _grammar(value: Grammar | Mapping[str, Any]) -> Grammar:
    if isinstance(value, Grammar):
        return value
    if not isinstance(value, Mapping) or set(value) - {"type", "value"}:
        raise TypeError('grammar must be a Grammar or a {"type": ..., "value": ...} mapping')
    # `value` is any JSON value: a schema object for "json", a pattern string for "regex".
    return Grammar(type=str(value.get("type", "")), value=Value.from_dict(value.get("value")))


def build_request(inputs: Prompt, parameters: Mapping[str, Any]) -> GenerateRequest:
    """Returns the GenerateRequest for a prompt and TGI-style parameters.

    `inputs` is a str, or a sequence of parts (str text and images: Image, ImagePart, bytes or
    a pathlib.Path of an image file), which fill the request's typed `input_chunks`.
    Raises TypeError for a part or a parameter name of another kind; values are checked by the
    server, which answers INVALID_ARGUMENT (ValidationError) naming the field.
    """
    chunks = None if isinstance(inputs, str) else input_chunks(inputs)
    unknown = sorted(set(parameters) - PARAMETER_NAMES)
    if unknown:
        raise TypeError(
            f"unknown generation parameter(s): {', '.join(unknown)}; "
            f"expected some of: {', '.join(sorted(PARAMETER_NAMES))}"
        )
    fields = dict(parameters)
    if fields.get("grammar") is not None:
        fields["grammar"] = _grammar(fields["grammar"])
    if fields.get("stop") is not None:
        fields["stop"] = list(fields["stop"])
    fields = {name: value for name, value in fields.items() if value is not None}
    if chunks is not None:
        return GenerateRequest(input_chunks=chunks, parameters=GenerateParameters(**fields))
    return GenerateRequest(inputs=inputs, parameters=GenerateParameters(**fields))


def auth_metadata(api_key: str | None) -> list[tuple[str, str]]:
    """The call metadata that carries the API key, as the router expects it."""
    return [] if api_key is None else [("authorization", f"Bearer {api_key}")]


def _check_names(parameters: Mapping[str, Any], allowed: frozenset[str]) -> dict[str, Any]:
    unknown = sorted(set(parameters) - allowed)
    if unknown:
        raise TypeError(
            f"unknown parameter(s): {', '.join(unknown)}; expected some of: "
            f"{', '.join(sorted(allowed))}"
        )
    fields = {name: value for name, value in parameters.items() if value is not None}
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    elif fields.get("stop") is not None:
        fields["stop"] = list(fields["stop"])
    return fields


def _message(message: ChatMessage | Mapping[str, Any], i: int) -> ChatMessage:
    if isinstance(message, ChatMessage):
        return message
    if not isinstance(message, Mapping):
        raise TypeError("messages must be ChatMessage objects or {'role', 'content'} mappings")
    fields = {k: v for k, v in message.items() if v is not None}
    content = fields.get("content")
    if content is not None and not isinstance(content, str):
        # OpenAI's list of parts ({"type": "text" | "image_url", ...}, or Image objects).
        if not isinstance(content, Sequence) or isinstance(content, (bytes, bytearray)):
            raise TypeError(f"messages[{i}].content must be a str or a list of content parts, "
                            f"not {type(content).__name__}")
        fields["content_parts"] = content_parts(content, f"messages[{i}].content")
        del fields["content"]
    if "tool_calls" in fields:  # OpenAI's shape: {id, type, function: {name, arguments}}
        fields["tool_calls"] = [
            c if isinstance(c, ToolCall) else ToolCall(
                id=c.get("id", ""), type=c.get("type", "function"),
                function=FunctionCall(**c.get("function", {})),
            )
            for c in fields["tool_calls"]
        ]
    return ChatMessage(**fields)


def _openai_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """OpenAI-shaped response_format / tools / tool_choice mappings as the request's messages
    (generated messages pass through)."""
    rf = fields.get("response_format")
    if isinstance(rf, Mapping):
        schema = rf.get("json_schema")
        fields["response_format"] = ResponseFormat(
            type=rf.get("type", "text"),
            json_schema=None if schema is None else JsonSchemaFormat(
                name=schema.get("name", ""), description=schema.get("description"),
                schema=Struct.from_dict(schema.get("schema", {})),
                strict=bool(schema.get("strict", False)),
            ),
        )
    if fields.get("tools") is not None:
        tools = []
        for tool in fields["tools"]:
            if isinstance(tool, Mapping):
                f = tool.get("function", {})
                tool = Tool(type=tool.get("type", "function"), function=FunctionDefinition(
                    name=f.get("name", ""), description=f.get("description"),
                    parameters=Struct.from_dict(f.get("parameters", {"type": "object"})),
                    strict=bool(f.get("strict", False)),
                ))
            tools.append(tool)
        fields["tools"] = tools
    choice = fields.get("tool_choice")
    if isinstance(choice, str):
        fields["tool_choice"] = ToolChoice(mode=choice)
    elif isinstance(choice, Mapping):
        fields["tool_choice"] = ToolChoice(function=choice.get("function", {}).get("name", ""))
    return fields


def build_chat_request(
    model: str, messages: Sequence[ChatMessage | Mapping[str, Any]], parameters: Mapping[str, Any]
) -> ChatRequest:
    """The ChatRequest for OpenAI-style messages ({"role", "content"} mappings or ChatMessage)
    and parameters (max_tokens, temperature, top_p, seed, stop, n, logprobs, ...)."""
    fields = _openai_fields(_check_names(parameters, CHAT_PARAMETER_NAMES))
    return ChatRequest(
        model=model, messages=[_message(m, i) for i, m in enumerate(messages)], **fields
    )


def build_completion_request(
    model: str, prompt: str, parameters: Mapping[str, Any]
) -> CompletionRequest:
    """The CompletionRequest for a string prompt and OpenAI-style parameters."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, not {type(prompt).__name__}")
    fields = _check_names(parameters, COMPLETION_PARAMETER_NAMES)
    return CompletionRequest(model=model, prompt=prompt, **fields)
