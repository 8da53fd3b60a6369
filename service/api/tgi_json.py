"""TGI's JSON <-> the public API's domain objects: request bodies in, responses, SSE events and
error bodies out, as text-generation-inference writes them (docs/openapi.json; router/src/lib.rs
for which fields are `null` and which are left out; server.rs and infer/mod.rs for the status
and `error_type` of each failure).

What proto3's JSON mapping (Envoy's transcoder) cannot write and this module does: `null` for
`generated_text` / `details` of a stream's non-final events, for the first prompt token's
`logprob` and for `seed` of greedy requests; 64-bit integers as JSON numbers; TGI's 1-based
stream `index`; a bare JSON array for POST /; `{"error", "error_type"}` bodies with TGI's
statuses (422 validation, 424 generation, 429 overloaded, 503 not ready).

Requests are decoded as TGI's serde does: unknown fields are ignored, a wrong type is a
ValidationError naming the field (422), `null` means "not set".
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc

from service.api.status import classify, public_message
from service.engine.adapters import AdapterInfo
from service.engine.contracts import TokenInfo
from service.generation.errors import ValidationError
from service.generation.service import (
    GeneratedSequence,
    GenerateOutcome,
    RequestTimings,
    ServerInfo,
    StreamItem,
)
from service.generation.validation import GenerateInput, GrammarInput

JSON = "application/json"
EVENT_STREAM = "text/event-stream"
TEXT = "text/plain; version=0.0.4; charset=utf-8"
_UINT32 = 1 << 32
_UINT64 = 1 << 64

# gRPC status of a domain error -> TGI's HTTP status and error_type (server.rs, infer/mod.rs):
# a failed generation is 424 "generation"; not serving (warming up, draining, shard down) is 503.
_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.OUT_OF_RANGE: (413, "validation"),
    grpc.StatusCode.INVALID_ARGUMENT: (422, "validation"),
    grpc.StatusCode.UNIMPLEMENTED: (422, "validation"),
    grpc.StatusCode.FAILED_PRECONDITION: (422, "validation"),
    grpc.StatusCode.ALREADY_EXISTS: (422, "validation"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "unauthorized"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (424, "generation"),
    grpc.StatusCode.INTERNAL: (424, "generation"),
}


def dumps(value: object) -> bytes:
    """Compact JSON (serde_json's separators), non-ASCII kept as UTF-8; NaN/inf become null."""
    return json.dumps(_finite(value), ensure_ascii=False, separators=(",", ":")).encode()


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # serde_json writes a NaN f32 (the first prompt token's logprob) as null
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


# --- requests ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TgiRequest:
    """A decoded TGI generate body: the domain input, `stream` (POST / only) and the
    tokenwire-only `coalesce_tokens` option of SSE streams."""

    input: GenerateInput
    stream: bool = False
    coalesce_tokens: bool = False


def body_object(data: bytes) -> dict[str, Any]:
    """The request body as a JSON object; ValidationError (422) when it is not one."""
    try:
        body = json.loads(data or b"null")
    except ValueError as error:
        raise ValidationError("body", f"the request body is not valid JSON ({error})") from None
    if not isinstance(body, dict):
        raise ValidationError(
            "body", f"the request body must be a JSON object; got {type(body).__name__}"
        )
    return body


def _number(params: dict[str, Any], name: str) -> float | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(
            f"parameters.{name}", f"parameters.{name} must be a number; got {value!r}"
        )
    return float(value)


def _integer(params: dict[str, Any], name: str, *, limit: int = _UINT32) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(
            f"parameters.{name}", f"parameters.{name} must be an integer; got {value!r}"
        )
    if not 0 <= value < limit:
        raise ValidationError(
            f"parameters.{name}",
            f"parameters.{name} must be in [0, {limit - 1}]; got {value}",
        )
    return value


def _boolean(body: dict[str, Any], name: str, where: str = "parameters.") -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValidationError(f"{where}{name}", f"{where}{name} must be a boolean; got {value!r}")
    return value


def _stop(params: dict[str, Any]) -> tuple[str, ...]:
    value = params.get("stop")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValidationError(
            "parameters.stop", f"parameters.stop must be a list of strings; got {value!r}"
        )
    return tuple(value)


def _grammar(params: dict[str, Any]) -> GrammarInput | None:
    value = params.get("grammar")
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ValidationError(
            "parameters.grammar",
            'parameters.grammar must be {"type": "json" | "json_schema" | "regex", "value": ...}'
            f"; got {value!r}",
        )
    kind, inner = value["type"], value.get("value")
    if kind == "json_schema":
        # TGI's third form: {"type": "json_schema", "value": {"name": ..., "schema": {...}}}.
        if not isinstance(inner, dict) or not isinstance(inner.get("schema"), (dict, str)):
            raise ValidationError(
                "parameters.grammar.value",
                'parameters.grammar.value must be {"name": ..., "schema": {...}} for type '
                f"json_schema; got {inner!r}",
            )
        return GrammarInput(type="json", value=inner["schema"])
    return GrammarInput(type=kind, value=inner)


def generate_request(data: bytes) -> TgiRequest:
    """Decodes TGI's `{"inputs", "parameters", "stream"}`; raises ValidationError naming the
    field whose type is wrong (the values themselves are checked by the validator)."""
    return generate_from(body_object(data))


def generate_from(body: dict[str, Any]) -> TgiRequest:
    inputs = body.get("inputs")
    if not isinstance(inputs, str):
        raise ValidationError("inputs", f"inputs is required and must be a string; got {inputs!r}")
    params = body.get("parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ValidationError("parameters", f"parameters must be an object; got {params!r}")
    adapter = params.get("adapter_id")
    if adapter is not None and not isinstance(adapter, str):
        raise ValidationError(
            "parameters.adapter_id", f"parameters.adapter_id must be a string; got {adapter!r}"
        )
    generate = GenerateInput(
        inputs=inputs,
        best_of=_integer(params, "best_of"),
        temperature=_number(params, "temperature"),
        repetition_penalty=_number(params, "repetition_penalty"),
        frequency_penalty=_number(params, "frequency_penalty"),
        top_k=_integer(params, "top_k", limit=1 << 31),
        top_p=_number(params, "top_p"),
        typical_p=_number(params, "typical_p"),
        do_sample=_boolean(params, "do_sample"),
        max_new_tokens=_integer(params, "max_new_tokens"),
        return_full_text=_boolean(params, "return_full_text"),
        stop=_stop(params),
        truncate=_integer(params, "truncate"),
        watermark=_boolean(params, "watermark"),
        details=_boolean(params, "details"),
        decoder_input_details=_boolean(params, "decoder_input_details"),
        seed=_integer(params, "seed", limit=_UINT64),
        top_n_tokens=_integer(params, "top_n_tokens"),
        grammar=_grammar(params),
        adapter_id=adapter or None,
    )
    return TgiRequest(
        generate,
        stream=_boolean(body, "stream", where=""),
        coalesce_tokens=_boolean(params, "coalesce_tokens"),
    )


def with_default_full_text(request: TgiRequest, body: dict[str, Any], default: bool) -> TgiRequest:
    """POST /: an unset `return_full_text` takes the server's default (TGI: true when the model's
    pipeline tag is text-generation)."""
    params = body.get("parameters")
    if isinstance(params, dict) and params.get("return_full_text") is not None:
        return request
    return replace(request, input=replace(request.input, return_full_text=default))


# --- responses -----------------------------------------------------------------------------


def token(info: TokenInfo) -> dict[str, Any]:
    return {"id": info.id, "text": info.text, "logprob": info.logprob, "special": info.special}


def prefill_token(info: TokenInfo) -> dict[str, Any]:
    return {"id": info.id, "text": info.text, "logprob": info.logprob}


def _sequence_fields(seq: GeneratedSequence, prefill: bool) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "finish_reason": seq.finish_reason.value,
        "generated_tokens": seq.generated_tokens,
        "seed": seq.seed,
        "prefill": [prefill_token(t) for t in seq.prefill] if prefill else [],
        "tokens": [token(t) for t in seq.tokens],
    }
    return fields


def generate_response(outcome: GenerateOutcome) -> dict[str, Any]:
    """TGI's GenerateResponse: `details` only when asked for; inside it `best_of_sequences` only
    for best_of > 1 and `top_tokens` only when non-empty (TGI's skip_serializing_if)."""
    best, options = outcome.best, outcome.options
    body: dict[str, Any] = {"generated_text": best.generated_text}
    if not (options.details or options.decoder_input_details):
        return body
    details = _sequence_fields(best, options.decoder_input_details)
    if outcome.others:
        details["best_of_sequences"] = [_best_of(s, options.decoder_input_details)
                                        for s in outcome.others]  # fmt: skip
    if best.top_tokens:
        details["top_tokens"] = [[token(t) for t in p] for p in best.top_tokens]
    if best.tokens_per_step:
        details["accepted_tokens_per_step"] = list(best.tokens_per_step)
    body["details"] = details
    return body


def _best_of(seq: GeneratedSequence, prefill: bool) -> dict[str, Any]:
    body = {"generated_text": seq.generated_text, **_sequence_fields(seq, prefill)}
    if seq.top_tokens:
        body["top_tokens"] = [[token(t) for t in p] for p in seq.top_tokens]
    return body


def sse(body: object) -> bytes:
    return b"data:" + dumps(body) + b"\n\n"


def stream_event(items: Sequence[StreamItem], coalesced: bool) -> dict[str, Any]:
    """TGI's StreamResponse for the last of `items` (one item unless `coalesced`): `index` is
    1-based as TGI counts it, `generated_text` and `details` are null until the last event."""
    item = items[-1]
    body: dict[str, Any] = {"index": item.index + 1, "token": token(item.token)}
    if item.top_tokens:
        body["top_tokens"] = [token(t) for t in item.top_tokens]
    body["generated_text"] = item.generated_text
    details = None
    if item.finished is not None and item.options.details:
        details = {
            "finish_reason": item.finished.finish_reason.value,
            "generated_tokens": item.finished.generated_tokens,
            "seed": item.finished.seed,
            "input_length": item.options.input_length,
        }
        if item.finished.tokens_per_step:
            details["accepted_tokens_per_step"] = list(item.finished.tokens_per_step)
    body["details"] = details
    if coalesced:
        extra: dict[str, Any] = {"tokens": [token(i.token) for i in items]}
        if any(i.top_tokens for i in items):
            extra["top_tokens"] = [{"tokens": [token(t) for t in i.top_tokens]} for i in items]
        body["coalesced"] = extra
    return body


def info(info: ServerInfo, adapters: list[AdapterInfo]) -> dict[str, Any]:
    """TGI's Info (every field it writes, in its order) and then tokenwire's own."""
    return {
        "model_id": info.model_id,
        "model_sha": info.model_sha,
        "model_pipeline_tag": info.model_pipeline_tag,
        "max_concurrent_requests": info.max_concurrent_requests,
        "max_best_of": info.max_best_of,
        "max_stop_sequences": info.max_stop_sequences,
        "max_input_tokens": info.max_input_tokens,
        "max_total_tokens": info.max_total_tokens,
        "validation_workers": info.validation_workers,
        "max_client_batch_size": info.max_client_batch_size,
        "router": info.router,
        "version": info.version,
        "sha": info.sha,
        "docker_label": info.docker_label,
        # TGI v2's router fields (the scheduler's batch limits), which clients written for it read.
        "max_batch_total_tokens": info.max_batch_total_tokens,
        "max_batch_size": info.max_batch_size,
        "waiting_served_ratio": info.waiting_served_ratio,
        "max_waiting_tokens": info.max_waiting_tokens,
        "model_dtype": info.model_dtype,
        "model_device_type": info.model_device_type,
        "max_top_n_tokens": info.max_top_n_tokens,
        "block_size": info.block_size,
        "num_kv_blocks": info.num_kv_blocks,
        "num_shard": info.num_shard,
        "speculate": info.speculate,
        "max_loras": info.max_loras,
        "max_lora_rank": info.max_lora_rank,
        "adapters": [
            {
                "name": a.name,
                "path": a.path,
                "rank": a.rank,
                "alpha": a.alpha,
                "target_modules": list(a.target_modules),
            }
            for a in adapters
        ],
    }


def timing_headers(
    compute_type: str, characters: int, timings: RequestTimings, input_length: int,
    generated_tokens: int,
) -> list[tuple[str, str]]:  # fmt: skip
    """TGI's x-compute-* / x-*-time headers of POST /generate (times in whole milliseconds but
    x-compute-time, which is seconds)."""
    per_token = timings.inference_seconds / max(generated_tokens, 1)
    return [
        ("x-compute-type", compute_type),
        ("x-compute-time", repr(round(timings.total_seconds, 6))),
        ("x-compute-characters", str(characters)),
        ("x-total-time", str(int(timings.total_seconds * 1e3))),
        ("x-validation-time", str(int(timings.validation_seconds * 1e3))),
        ("x-queue-time", str(int(timings.queue_seconds * 1e3))),
        ("x-inference-time", str(int(timings.inference_seconds * 1e3))),
        ("x-time-per-token", str(int(per_token * 1e3))),
        ("x-prompt-tokens", str(input_length)),
        ("x-generated-tokens", str(generated_tokens)),
    ]


# --- errors --------------------------------------------------------------------------------


def error_status(error: BaseException) -> tuple[int, str]:
    """TGI's HTTP status and error_type for a domain error."""
    return _HTTP.get(classify(error).code, (424, "generation"))


def error_body(error: BaseException) -> tuple[int, bytes]:
    """TGI's ErrorResponse for `error` and its HTTP status."""
    status, error_type = error_status(error)
    return status, dumps({"error": public_message(error), "error_type": error_type})


def error_event(error: BaseException) -> bytes:
    """The in-band SSE event of a failed stream (TGI sends it with status 200)."""
    return sse({"error": public_message(error), "error_type": error_status(error)[1]})
