"""tokenwire.v1.OpenAIService's typed messages <-> the OpenAI domain objects
(service.generation.openai). The HttpBody routes use service.api.openai_json instead."""

from __future__ import annotations

from tokenwire.v1 import openai_pb2 as pb

from service.generation.openai import (
    ChatMessage,
    ChatRequest,
    Choice,
    ChoiceDelta,
    Completed,
    CompletionRequest,
    ResponseHeader,
    SamplingRequest,
    StreamEvent,
    TokenLogprob,
    Usage,
    UsageChunk,
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
    messages = tuple(
        ChatMessage(
            role=m.role,
            content=m.content,
            name=m.name if m.HasField("name") else None,
            tool_call_id=m.tool_call_id if m.HasField("tool_call_id") else None,
        )
        for m in request.messages
    )
    return ChatRequest(messages, params)


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
        message=pb.ChatMessage(role="assistant", content=choice.text),
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
