"""Public protos ↔ the public API's domain objects. The only module that knows both."""

from __future__ import annotations

import math
import time

from google.protobuf import json_format
from tokenwire.v1 import generate_pb2 as pb

from service.api.status import ErrorKind
from service.engine.adapters import AdapterInfo, AdapterSource
from service.engine.contracts import TokenInfo
from service.generation.images.refs import ImageRef
from service.generation.service import (
    GeneratedSequence,
    GenerateOutcome,
    ServerInfo,
    StreamItem,
)
from service.generation.validation import GenerateInput, GrammarInput


def _opt(params: pb.GenerateParameters, name: str) -> float | int | None:
    return getattr(params, name) if params.HasField(name) else None


def generate_input(request: pb.GenerateRequest) -> GenerateInput:
    """Decodes a GenerateRequest; unset optional fields become None."""
    p = request.parameters
    grammar = None
    if p.HasField("grammar"):
        value = json_format.MessageToDict(p.grammar.value) if p.grammar.HasField("value") else None
        grammar = GrammarInput(type=p.grammar.type, value=value)
    return GenerateInput(
        inputs=request.inputs,
        best_of=_opt(p, "best_of"),  # type: ignore[arg-type]
        temperature=_opt(p, "temperature"),
        repetition_penalty=_opt(p, "repetition_penalty"),
        frequency_penalty=_opt(p, "frequency_penalty"),
        top_k=_opt(p, "top_k"),  # type: ignore[arg-type]
        top_p=_opt(p, "top_p"),
        typical_p=_opt(p, "typical_p"),
        do_sample=p.do_sample,
        max_new_tokens=_opt(p, "max_new_tokens"),  # type: ignore[arg-type]
        return_full_text=p.return_full_text,
        stop=tuple(p.stop),
        truncate=_opt(p, "truncate"),  # type: ignore[arg-type]
        watermark=p.watermark,
        details=p.details,
        decoder_input_details=p.decoder_input_details,
        seed=_opt(p, "seed"),  # type: ignore[arg-type]
        top_n_tokens=_opt(p, "top_n_tokens"),  # type: ignore[arg-type]
        grammar=grammar,
        adapter_id=_opt(p, "adapter_id"),  # type: ignore[arg-type]
        input_chunks=tuple(_chunk(c, i) for i, c in enumerate(request.input_chunks)),
    )


def _chunk(chunk: pb.InputChunk, i: int) -> str | ImageRef:
    """A typed prompt part: its text, or the image it names (errors name input_chunks[i])."""
    if chunk.WhichOneof("chunk") != "image":
        return chunk.text
    image = chunk.image
    field = f"input_chunks[{i}].image"
    if image.WhichOneof("source") == "data":
        return ImageRef(field, data=image.data)
    return ImageRef(field, url=image.url)


# Slack kept between the engine's deadline and the gRPC one: the engine drops a request at a step
# boundary, and the error must still reach the client (in band for SSE clients behind Envoy)
# before grpc cancels the call at the real deadline. At most 100 ms, at most a fifth of the time.
DEADLINE_SLACK_S = 0.1
DEADLINE_SLACK_FRACTION = 0.2


def deadline(time_remaining: float | None) -> float | None:
    """The gRPC deadline (seconds remaining, None without one) as the time.monotonic() instant
    at which the engine gives up on the request, a little before grpc does."""
    if time_remaining is None:
        return None
    remaining = max(0.0, time_remaining)
    slack = min(DEADLINE_SLACK_S, DEADLINE_SLACK_FRACTION * remaining)
    return time.monotonic() + remaining - slack


def token(info: TokenInfo) -> pb.Token:
    return pb.Token(id=info.id, text=info.text, logprob=info.logprob, special=info.special)


def prefill_token(info: TokenInfo) -> pb.PrefillToken:
    message = pb.PrefillToken(id=info.id, text=info.text)
    if not math.isnan(info.logprob):
        message.logprob = info.logprob
    return message


def _top_tokens(per_position: tuple[tuple[TokenInfo, ...], ...]) -> list[pb.TopTokens]:
    return [pb.TopTokens(tokens=[token(t) for t in position]) for position in per_position]


def _best_of_sequence(seq: GeneratedSequence) -> pb.BestOfSequence:
    message = pb.BestOfSequence(
        generated_text=seq.generated_text,
        finish_reason=seq.finish_reason.value,
        generated_tokens=seq.generated_tokens,
        prefill=[prefill_token(t) for t in seq.prefill],
        tokens=[token(t) for t in seq.tokens],
        top_tokens=_top_tokens(seq.top_tokens),
        accepted_tokens_per_step=seq.tokens_per_step,
    )
    if seq.seed is not None:
        message.seed = seq.seed
    return message


def generate_response(outcome: GenerateOutcome) -> pb.GenerateResponse:
    """Encodes a finished Generate; details only when asked for."""
    best, options = outcome.best, outcome.options
    response = pb.GenerateResponse(generated_text=best.generated_text)
    if options.details or options.decoder_input_details:
        details = pb.Details(
            finish_reason=best.finish_reason.value,
            generated_tokens=best.generated_tokens,
            prefill=[prefill_token(t) for t in best.prefill]
            if options.decoder_input_details
            else [],
            tokens=[token(t) for t in best.tokens],
            top_tokens=_top_tokens(best.top_tokens),
            best_of_sequences=[_best_of_sequence(s) for s in outcome.others],
            accepted_tokens_per_step=best.tokens_per_step,
        )
        if best.seed is not None:
            details.seed = best.seed
        response.details.CopyFrom(details)
    return response


def stream_response(item: StreamItem) -> pb.GenerateStreamResponse:
    """Encodes one stream event; the last one carries generated_text and (when asked) details."""
    t = item.token
    token_pb = pb.Token(id=t.id, text=t.text, logprob=t.logprob, special=t.special)
    if item.top_tokens:
        response = pb.GenerateStreamResponse(
            index=item.index, token=token_pb, top_tokens=[token(x) for x in item.top_tokens]
        )
    else:  # the hot path: one message per generated token
        response = pb.GenerateStreamResponse(index=item.index, token=token_pb)
    if item.generated_text is not None:
        response.generated_text = item.generated_text
    if item.finished is not None and item.options.details:
        details = pb.StreamDetails(
            finish_reason=item.finished.finish_reason.value,
            generated_tokens=item.finished.generated_tokens,
            input_length=item.options.input_length,
            accepted_tokens_per_step=item.finished.tokens_per_step,
        )
        if item.finished.seed is not None:
            details.seed = item.finished.seed
        response.details.CopyFrom(details)
    return response


def stream_response_coalesced(items: list[StreamItem]) -> pb.GenerateStreamResponse:
    """Encodes consecutive stream events as ONE event (parameters.coalesce_tokens): `coalesced`
    lists them all; `token`, `top_tokens`, `index` and the last event's fields are the last's."""
    response = stream_response(items[-1])
    coalesced = response.coalesced
    coalesced.SetInParent()
    coalesced.tokens.extend(
        pb.Token(id=t.id, text=t.text, logprob=t.logprob, special=t.special)
        for t in (item.token for item in items)
    )
    if any(item.top_tokens for item in items):
        coalesced.top_tokens.extend(
            pb.TopTokens(tokens=[token(x) for x in item.top_tokens]) for item in items
        )
    return response


def stream_error(index: int, kind: ErrorKind, message: str) -> pb.GenerateStreamResponse:
    """The in-band error event that ends a stream which already sent events."""
    return pb.GenerateStreamResponse(index=index, error=message, error_type=kind.error_type)


def adapter(info: AdapterInfo) -> pb.Adapter:
    return pb.Adapter(name=info.name, path=info.path, rank=info.rank, alpha=info.alpha,
                      target_modules=list(info.target_modules))


def adapter_sources(request: pb.LoadAdapterRequest) -> list[AdapterSource]:
    return [
        AdapterSource(a.name, a.path, a.revision if a.HasField("revision") else None)
        for a in request.adapters
    ]


def info_response(info: ServerInfo, adapters: list[AdapterInfo] | None = None) -> pb.InfoResponse:
    response = pb.InfoResponse(
        model_id=info.model_id,
        model_dtype=info.model_dtype,
        model_device_type=info.model_device_type,
        max_concurrent_requests=info.max_concurrent_requests,
        max_best_of=info.max_best_of,
        max_stop_sequences=info.max_stop_sequences,
        max_input_tokens=info.max_input_tokens,
        max_total_tokens=info.max_total_tokens,
        validation_workers=info.validation_workers,
        max_client_batch_size=info.max_client_batch_size,
        router=info.router,
        version=info.version,
        max_top_n_tokens=info.max_top_n_tokens,
        max_batch_total_tokens=info.max_batch_total_tokens,
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        num_shard=info.num_shard,
        adapters=[adapter(a) for a in adapters or []],
        max_loras=info.max_loras,
        max_lora_rank=info.max_lora_rank,
        speculate=info.speculate,
        model_impl=info.model_impl,
        cuda_graphs=info.cuda_graphs,
    )
    for name in ("model_sha", "model_pipeline_tag", "sha", "docker_label"):
        value = getattr(info, name)
        if value is not None:
            setattr(response, name, value)
    return response
