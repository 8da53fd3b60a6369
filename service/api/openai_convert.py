"""tokenwire.v1.OpenAIService's typed messages <-> the OpenAI domain objects
(service.generation.openai). The HttpBody routes use service.api.openai_json instead."""

from __future__ import annotations

from typing import cast

from google.protobuf import json_format
from tokenwire.v1 import openai_pb2 as pb

from service.generation.errors import ValidationError
from service.generation.grammar import FUNCTION_NAME_RE, FunctionTool
from service.generation.images.refs import ImageRef
from service.generation.openai import (
    ChatMessage,
    ChatRequest,
    Choice,
    ChoiceDelta,
    Completed,
    CompletionRequest,
    ResponseFormat,
    ResponseHeader,
    SamplingRequest,
    StreamEvent,
    TokenLogprob,
    ToolCall,
    ToolChoice,
    Usage,
    UsageChunk,
    image_url_ref,
    message_content,
)


def _opt(message: pb.ChatRequest | pb.CompletionRequest, name: str) -> float | int | None:
    return getattr(message, name) if message.HasField(name) else None


def _sampling(request: pb.ChatRequest | pb.CompletionRequest, stream: bool) -> SamplingRequest:
    return SamplingRequest(
        model=request.model,
        max_tokens=_opt(request, "max_tokens"),  # type: ignore[arg-type]
        temperature=_opt(request, "temperature"),
        top_p=_opt(request, "top_p"),
        seed=_opt(request, "seed"),  # type: ignore[arg-type]
        stop=tuple(request.stop),
        frequency_penalty=_opt(request, "frequency_penalty"),
        presence_penalty=_opt(request, "presence_penalty"),
        n=request.n if request.HasField("n") else 1,
        stream=stream,
        include_usage=stream and request.include_usage,
    )


def chat_request(request: pb.ChatRequest, *, stream: bool) -> ChatRequest:
    params = _sampling(request, stream)
    params = SamplingRequest(
        **{
            **params.__dict__,
            "logprobs": request.logprobs,
            "top_logprobs": request.top_logprobs or None,
        }
    )
    messages = tuple(_message(m, i) for i, m in enumerate(request.messages))
    tools = tuple(_tool(t, i) for i, t in enumerate(request.tools))
    choice = None
    if request.HasField("tool_choice"):
        which = request.tool_choice.WhichOneof("choice")
        if which == "function":
            choice = ToolChoice("function", request.tool_choice.function)
        else:
            choice = ToolChoice(request.tool_choice.mode or "auto")
        if choice.mode not in ("auto", "none", "required", "function"):
            raise ValidationError(
                "tool_choice", f"tool_choice.mode must be auto, none or required; got {choice.mode!r}"
            )
        if choice.mode == "function" and choice.function not in {t.name for t in tools}:
            raise ValidationError(
                "tool_choice", f"tool_choice names {choice.function!r}, which is not in tools"
            )
        if choice.mode in ("required", "function") and not tools:
            raise ValidationError("tool_choice", f"tool_choice {choice.mode!r} needs tools")
    return ChatRequest(
        messages,
        params,
        response_format=_response_format(request),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=(
            request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
        ),
    )


def _message(m: pb.ChatMessage, i: int) -> ChatMessage:
    text, images = m.content, cast(tuple[tuple[int, ImageRef], ...], ())
    if m.content_parts:
        where = f"messages[{i}].content_parts"
        if m.content:
            raise ValidationError(f"messages[{i}].content", f"messages[{i}]: set content or "
                                  "content_parts, not both")
        text, images = message_content(
            m.role, [_part(p, f"{where}[{j}]") for j, p in enumerate(m.content_parts)], where)
    return ChatMessage(
        role=m.role,
        content=text,
        images=images,
        name=m.name if m.HasField("name") else None,
        tool_call_id=m.tool_call_id if m.HasField("tool_call_id") else None,
        tool_calls=tuple(
            ToolCall(c.id, c.function.name, c.function.arguments or "{}") for c in m.tool_calls
        ),
    )


def _part(part: pb.ChatContentPart, where: str) -> str | ImageRef:
    """A typed content part: its text, or its image named `where.image_url` (as REST's
    `messages[i].content[j].image_url`)."""
    which = part.WhichOneof("part")
    if which == "image_url":
        return image_url_ref(part.image_url.url, f"{where}.image_url")
    if which is None:
        raise ValidationError(where, f"{where}: a content part needs text or image_url")
    return part.text


def _response_format(request: pb.ChatRequest) -> ResponseFormat | None:
    if not request.HasField("response_format"):
        return None
    rf = request.response_format
    if rf.type in ("", "text", "json_object"):
        return ResponseFormat(rf.type or "text")
    if rf.type != "json_schema":
        raise ValidationError(
            "response_format",
            f"response_format.type must be text, json_object or json_schema; got {rf.type!r}",
        )
    schema = json_format.MessageToDict(rf.json_schema.schema)
    return ResponseFormat("json_schema", schema, rf.json_schema.strict)


def _tool(tool: pb.Tool, i: int) -> FunctionTool:
    f = tool.function
    if tool.type not in ("", "function"):
        raise ValidationError(f"tools[{i}]", f"tools[{i}].type must be 'function'")
    if not FUNCTION_NAME_RE.match(f.name):
        raise ValidationError(
            f"tools[{i}].function.name",
            f"tools[{i}].function.name must be letters, digits, _ and - (at most 64); got "
            f"{f.name!r}",
        )
    parameters = (
        json_format.MessageToDict(f.parameters)
        if f.HasField("parameters")
        else {"type": "object", "properties": {}}
    )
    return FunctionTool(
        f.name, f.description if f.HasField("description") else None, parameters, f.strict
    )


def completion_request(request: pb.CompletionRequest, *, stream: bool) -> CompletionRequest:
    return CompletionRequest(request.prompt, _sampling(request, stream), echo=request.echo)


def _usage(usage: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )


def _bytes(text: str) -> list[int]:
    return list(text.encode())


def _logprobs(entries: tuple[TokenLogprob, ...]) -> pb.ChoiceLogprobs:
    return pb.ChoiceLogprobs(
        content=[
            pb.TokenLogprob(
                token=e.token,
                logprob=e.logprob,
                bytes=_bytes(e.token),
                top_logprobs=[
                    pb.TopLogprob(token=t, logprob=lp, bytes=_bytes(t)) for t, lp in e.top
                ],
            )
            for e in entries
        ]
    )


def _head(header: ResponseHeader) -> dict[str, object]:
    return {
        "id": header.id,
        "created": header.created,
        "model": header.model,
        "system_fingerprint": header.system_fingerprint,
    }


def _chat_choice(choice: Choice) -> pb.ChatChoice:
    message = pb.ChatChoice(
        index=choice.index,
        message=pb.ChatMessage(
            role="assistant",
            content=choice.text,
            reasoning_content=choice.reasoning,
            tool_calls=[
                pb.ToolCall(
                    id=c.id,
                    type="function",
                    function=pb.FunctionCall(name=c.name, arguments=c.arguments),
                )
                for c in choice.tool_calls
            ],
        ),
        finish_reason=choice.finish_reason,
    )
    if choice.logprobs is not None:
        message.logprobs.CopyFrom(_logprobs(choice.logprobs))
    return message


def chat_response(completed: Completed) -> pb.ChatResponse:
    return pb.ChatResponse(
        object="chat.completion",
        choices=[_chat_choice(c) for c in completed.choices],
        usage=_usage(completed.usage),
        **_head(completed.header),  # type: ignore[arg-type]
    )


def chat_chunk(header: ResponseHeader, event: StreamEvent) -> pb.ChatStreamResponse:
    chunk = pb.ChatStreamResponse(object="chat.completion.chunk", **_head(header))  # type: ignore[arg-type]
    if isinstance(event, UsageChunk):
        chunk.usage.CopyFrom(_usage(event.usage))
        return chunk
    choice = chunk.choices.add(index=event.index)
    choice.delta.SetInParent()  # present even when empty (the finish chunk), as in OpenAI
    if event.first:
        choice.delta.role = "assistant"
    if event.first or event.text:
        choice.delta.content = event.text
    if event.reasoning:
        choice.delta.reasoning_content = event.reasoning
    for call in event.tool_calls:
        # A call's first piece carries id, type and name; later pieces only arguments.
        choice.delta.tool_calls.add(
            index=call.index,
            id=call.id or "",
            type="function" if call.id is not None else "",
            function=pb.FunctionCall(name=call.name or "", arguments=call.arguments),
        )
    if event.finish_reason is not None:
        choice.finish_reason = event.finish_reason
    if event.logprobs is not None:
        choice.logprobs.CopyFrom(_logprobs(event.logprobs))
    return chunk


def completion_response(completed: Completed) -> pb.CompletionResponse:
    return pb.CompletionResponse(
        object="text_completion",
        choices=[
            pb.CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason)
            for c in completed.choices
        ],
        usage=_usage(completed.usage),
        **_head(completed.header),  # type: ignore[arg-type]
    )


def completion_chunk(header: ResponseHeader, event: StreamEvent) -> pb.CompletionStreamResponse:
    chunk = pb.CompletionStreamResponse(object="text_completion", **_head(header))  # type: ignore[arg-type]
    if isinstance(event, UsageChunk):
        chunk.usage.CopyFrom(_usage(event.usage))
        return chunk
    assert isinstance(event, ChoiceDelta)
    choice = chunk.choices.add(index=event.index, text=event.text)
    if event.finish_reason is not None:
        choice.finish_reason = event.finish_reason
    return chunk


def models_response(model_id: str, created: int, adapters: list[str] | None = None
                    ) -> pb.ListModelsResponse:
    """The base model, then each LoRA adapter (with the base as its parent)."""
    return pb.ListModelsResponse(
        object="list",
        data=[pb.Model(id=model_id, object="model", created=created, owned_by="tokenwire")]
        + [
            pb.Model(id=name, object="model", created=created, owned_by="tokenwire",
                     parent=model_id)
            for name in adapters or []
        ],
    )
