"""Validation of generation requests with TGI's rules and limits, and two fixes of TGI's quirks:
`top_p = 1.0` / `typical_p = 1.0` mean "off" and `temperature = 0` means greedy decoding.

Every rejection is a `ValidationError` whose message names the field, the value and the limit.
Parameters are checked before tokenization (cheap failures first); token counts after it.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass, replace
from typing import Any

from service.engine.contracts import (
    GrammarSpec,
    ImageInput,
    SamplingConfig,
    StoppingConfig,
    ValidatedRequest,
)
from service.generation.errors import UnsupportedError, ValidationError
from service.generation.grammar import GrammarCompiler, json_schema_spec, regex_spec
from service.generation.images.markdown import markdown_images
from service.generation.images.pipeline import ImagePipeline
from service.generation.images.refs import ImageError, ImageRef
from service.generation.tokenization import Encoder

# TGI caps the default max_new_tokens at 100 when the client gives none.
DEFAULT_MAX_NEW_TOKENS_CAP = 100
FREQUENCY_PENALTY_RANGE = (-2.0, 2.0)
GRAMMAR_TYPES = ("json", "json_object", "regex")
GRAMMAR_FIELD = "parameters.grammar"
_U64 = 1 << 64


@dataclass(frozen=True)
class ValidationLimits:
    """The router's per-request limits (its flags of the same names)."""

    max_input_tokens: int
    max_total_tokens: int
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_client_batch_size: int = 4

    def __post_init__(self) -> None:
        if not 0 < self.max_input_tokens < self.max_total_tokens:
            raise ValueError(
                f"--max-input-tokens ({self.max_input_tokens}) must be > 0 and < "
                f"--max-total-tokens ({self.max_total_tokens})"
            )


@dataclass(frozen=True)
class GrammarInput:
    """An output constraint as the client sent it; `value` is the JSON value (dict, str, ...)."""

    type: str
    value: Any
    strict: bool = True  # an unsupported schema keyword is an error (else it is ignored)


@dataclass(frozen=True)
class GenerateInput:
    """A generation request as decoded from the wire, before validation. `None` means "not set"."""

    inputs: str
    best_of: int | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: int | None = None
    return_full_text: bool = False
    stop: tuple[str, ...] = ()
    truncate: int | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: int | None = None
    top_n_tokens: int | None = None
    grammar: GrammarInput | None = None
    # The prompt's token ids when the caller tokenized it (chat templates); None: tokenize inputs.
    prompt_ids: tuple[int, ...] | None = None
    # LoRA adapter name (TGI's parameters.adapter_id, OpenAI's model); None/"": base model.
    adapter_id: str | None = None
    # A constraint the caller built itself (OpenAI tool calls), checked under `grammar_field`;
    # set instead of `grammar`.
    grammar_spec: GrammarSpec | None = None
    grammar_field: str = GRAMMAR_FIELD
    # Images of the prompt, in order: one image token (ImagePipeline.image_token) stands for
    # each in inputs / prompt_ids (OpenAI chat content parts).
    images: tuple[ImageRef, ...] = ()
    # The prompt as typed text and image parts (the gRPC API's input_chunks); set instead of
    # inputs' text, which then only names the request in logs.
    input_chunks: tuple[str | ImageRef, ...] = ()


@dataclass(frozen=True)
class ResponseOptions:
    """What the response must contain, decided at validation."""

    prompt: str  # the client's inputs, for return_full_text
    input_length: int  # prompt tokens after truncation
    details: bool
    decoder_input_details: bool
    return_full_text: bool
    best_of: int


@dataclass(frozen=True)
class ValidatedGenerate:
    """A validated request: one engine request per best_of sequence, and the response options."""

    requests: tuple[ValidatedRequest, ...]
    options: ResponseOptions


@dataclass(frozen=True)
class _Parameters:
    """Checked, normalised parameters (everything but the token-count checks)."""

    sampling: SamplingConfig  # seed of the first sequence
    stop: tuple[str, ...]
    best_of: int
    seeds: tuple[int, ...]
    top_n_tokens: int
    grammar: GrammarSpec | None = None


def _fail(field: str, message: str) -> ValidationError:
    return ValidationError(field, f"{field} {message}")


def _finite(field: str, value: float) -> None:
    if not math.isfinite(value):
        raise _fail(field, f"must be a finite number; got {value}")


def _check_unit_interval(field: str, value: float | None) -> float:
    """(0, 1] with 1.0 meaning off; returns the normalised value (1.0 when unset)."""
    if value is None:
        return 1.0
    _finite(field, value)
    if not 0.0 < value <= 1.0:
        raise _fail(field, f"must be in (0, 1] (1.0 means off); got {value}")
    return value


def _check_grammar(grammar: GrammarInput | None) -> GrammarSpec | None:
    """The shards' form of a TGI grammar; raises ValidationError for a malformed one (whether
    it compiles is checked later, off the event loop)."""
    if grammar is None:
        return None
    if grammar.type not in GRAMMAR_TYPES:
        raise _fail(
            "parameters.grammar.type",
            f"must be one of {', '.join(GRAMMAR_TYPES)}; got {grammar.type!r}",
        )
    value = grammar.value
    if grammar.type == "json_object":
        # Any JSON object; a schema, when given, narrows it (OpenAI's json_object has none).
        if value is None:
            return json_schema_spec({"type": "object"}, strict=grammar.strict)
    if grammar.type in ("json", "json_object"):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as err:
                raise _fail(
                    "parameters.grammar.value", f"must be a JSON schema; got invalid JSON ({err})"
                ) from None
        if not isinstance(value, dict):
            raise _fail(
                "parameters.grammar.value",
                f"must be a JSON schema object for type {grammar.type}; got "
                f"{type(value).__name__}",
            )
        if grammar.type == "json_object":
            value = {**value, "type": "object"}
        return json_schema_spec(value, strict=grammar.strict)
    if not isinstance(value, str) or not value:
        raise _fail(
            "parameters.grammar.value",
            f"must be a non-empty regular expression string for type regex; got {value!r}",
        )
    try:
        re.compile(value)
    except re.error as err:
        raise _fail(
            "parameters.grammar.value",
            f"is not a valid regular expression ({err}); got {value!r}",
        ) from None
    return regex_spec(value)


def _draw_seed() -> int:
    return secrets.randbits(64)


def check_parameters(
    request: GenerateInput, limits: ValidationLimits, *, stream: bool
) -> _Parameters:
    """Checks everything that does not need the token count; raises ValidationError."""
    if not request.inputs and not request.input_chunks:
        raise _fail("inputs", "must not be empty")

    # Greedy unless sampling is asked for; temperature 0 means greedy whatever else is set.
    temperature = 1.0
    greedy_by_temperature = False
    if request.temperature is not None:
        _finite("parameters.temperature", request.temperature)
        if request.temperature < 0.0:
            raise _fail(
                "parameters.temperature",
                f"must be >= 0 (0 means greedy); got {request.temperature}",
            )
        if request.temperature == 0.0:
            greedy_by_temperature = True
        else:
            temperature = request.temperature

    repetition_penalty = 1.0
    if request.repetition_penalty is not None:
        _finite("parameters.repetition_penalty", request.repetition_penalty)
        if request.repetition_penalty <= 0.0:
            raise _fail(
                "parameters.repetition_penalty",
                f"must be > 0 (1.0 means off); got {request.repetition_penalty}",
            )
        repetition_penalty = request.repetition_penalty

    frequency_penalty = 0.0
    if request.frequency_penalty is not None:
        _finite("parameters.frequency_penalty", request.frequency_penalty)
        low, high = FREQUENCY_PENALTY_RANGE
        if not low <= request.frequency_penalty <= high:
            raise _fail(
                "parameters.frequency_penalty",
                f"must be in [{low}, {high}]; got {request.frequency_penalty}",
            )
        frequency_penalty = request.frequency_penalty

    top_k = 0
    if request.top_k is not None:
        if request.top_k <= 0:
            raise _fail("parameters.top_k", f"must be > 0 when set; got {request.top_k}")
        top_k = request.top_k

    top_p = _check_unit_interval("parameters.top_p", request.top_p)
    typical_p = _check_unit_interval("parameters.typical_p", request.typical_p)

    do_sample = not greedy_by_temperature and (
        request.do_sample or temperature != 1.0 or top_k > 0 or top_p < 1.0 or typical_p < 1.0
    )
    if not do_sample:
        # Warpers do nothing under greedy decoding: send the off values so batches stay uniform.
        temperature, top_k, top_p, typical_p = 1.0, 0, 1.0, 1.0

    best_of = 1
    if request.best_of is not None:
        if request.best_of == 0:
            raise _fail("parameters.best_of", "must be > 0 when set; got 0")
        if request.best_of > limits.max_best_of:
            raise _fail(
                "parameters.best_of",
                f"must be <= {limits.max_best_of} (--max-best-of); got {request.best_of}",
            )
        best_of = request.best_of
    if best_of > 1:
        if stream:
            raise _fail(
                "parameters.best_of", f"> 1 is not supported on GenerateStream; got {best_of}"
            )
        if not do_sample:
            why = "temperature 0 means greedy" if greedy_by_temperature else "sampling is off"
            raise _fail(
                "parameters.best_of",
                f"> 1 needs sampling (do_sample, temperature, top_k, top_p or typical_p), but "
                f"{why}; got best_of={best_of}",
            )

    if len(request.stop) > limits.max_stop_sequences:
        raise _fail(
            "parameters.stop",
            f"must have at most {limits.max_stop_sequences} entries (--max-stop-sequences); "
            f"got {len(request.stop)}",
        )
    for i, stop in enumerate(request.stop):
        if not stop:
            raise _fail(f"parameters.stop[{i}]", "must not be empty; got ''")

    if request.truncate is not None and not 0 < request.truncate <= limits.max_input_tokens:
        raise _fail(
            "parameters.truncate",
            f"must be in [1, {limits.max_input_tokens}] (--max-input-tokens) when set; "
            f"got {request.truncate}",
        )
    if request.max_new_tokens is not None and request.max_new_tokens <= 0:
        raise _fail(
            "parameters.max_new_tokens", f"must be > 0 when set; got {request.max_new_tokens}"
        )

    top_n_tokens = request.top_n_tokens or 0
    if top_n_tokens > limits.max_top_n_tokens:
        raise _fail(
            "parameters.top_n_tokens",
            f"must be <= {limits.max_top_n_tokens} (--max-top-n-tokens); got {top_n_tokens}",
        )
    if request.decoder_input_details and stream:
        raise _fail(
            "parameters.decoder_input_details", "is not supported on GenerateStream; got true"
        )
    if request.seed is not None and not 0 <= request.seed < _U64:
        raise _fail("parameters.seed", f"must be in [0, 2^64); got {request.seed}")

    grammar = request.grammar_spec or _check_grammar(request.grammar)

    # Distinct, reproducible seeds per best_of sequence: the client's seed, then seed+1, ...
    if request.seed is not None:
        seeds = tuple((request.seed + i) % _U64 for i in range(best_of))
    else:
        seeds = tuple(_draw_seed() for _ in range(best_of))
    sampling = SamplingConfig(
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        typical_p=typical_p,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        watermark=request.watermark,
        seed=seeds[0],
    )
    return _Parameters(
        sampling=sampling,
        stop=request.stop,
        best_of=best_of,
        seeds=seeds,
        top_n_tokens=top_n_tokens,
        grammar=grammar,
    )


def check_length(
    request: GenerateInput, limits: ValidationLimits, input_ids: tuple[int, ...]
) -> tuple[tuple[int, ...], int]:
    """Truncates the prompt when asked and checks the token budget; returns the prompt tokens and
    max_new_tokens (defaulted)."""
    if request.truncate is not None and len(input_ids) > request.truncate:
        input_ids = input_ids[-request.truncate :]
    input_length = len(input_ids)
    if input_length > limits.max_input_tokens:
        raise _fail(
            "inputs",
            f"must have at most {limits.max_input_tokens} tokens (--max-input-tokens); got "
            f"{input_length} tokens (set parameters.truncate to keep only the last tokens)",
        )
    room = limits.max_total_tokens - input_length
    if request.max_new_tokens is None:
        max_new_tokens = min(room, DEFAULT_MAX_NEW_TOKENS_CAP)
    else:
        max_new_tokens = request.max_new_tokens
        if max_new_tokens > room:
            raise _fail(
                "parameters.max_new_tokens",
                f"must be <= {room}: input tokens ({input_length}) + max_new_tokens must be <= "
                f"{limits.max_total_tokens} (--max-total-tokens); got {max_new_tokens}",
            )
    return input_ids, max_new_tokens


class Validator:
    """Validates and tokenizes requests against the router's limits."""

    def __init__(
        self,
        limits: ValidationLimits,
        encoder: Encoder,
        grammars: GrammarCompiler | None = None,
        images: ImagePipeline | None = None,
    ) -> None:
        self.limits = limits
        self._encoder = encoder
        self._grammars = grammars
        self.images = images  # None: the model takes no images

    async def validate(
        self,
        request: GenerateInput,
        *,
        request_id: str,
        stream: bool,
        deadline: float | None = None,
    ) -> ValidatedGenerate:
        """Returns the engine requests (one per best_of sequence) or raises ValidationError."""
        params = check_parameters(request, self.limits, stream=stream)
        if params.grammar is not None:
            if self._grammars is None:
                raise UnsupportedError(
                    f"{request.grammar_field}: constrained generation is not available on this "
                    "server (no grammar compiler)"
                )
            # Compiled before queueing (cached by content), on the compiler's thread.
            await self._grammars.check(params.grammar, request.grammar_field)
        typed = request.inputs  # what return_full_text echoes (markdown images included)
        request = self._image_prompt(request)
        if request.input_chunks:
            typed = request.inputs  # the chunks' text, an image token per image
        ids = request.prompt_ids
        if ids is None:
            ids = await self._encoder.encode(request.inputs)
        images: tuple[ImageInput, ...] = ()
        pipeline = self.images
        if request.images or (pipeline is not None and pipeline.image_token_id in ids):
            if pipeline is None:
                raise ImageError(request.images[0].field, f"{request.images[0].field}: this "
                                 "model takes no images (its snapshot has no image processor)")
            if request.truncate is not None:
                raise _fail("parameters.truncate", "cannot be combined with images")
            field = "messages" if request.prompt_ids is not None else "inputs"
            ids, images = await pipeline.prepare(request.images, ids, field)
        input_ids, max_new_tokens = check_length(request, self.limits, ids)
        stopping = StoppingConfig(max_new_tokens=max_new_tokens, stop_sequences=params.stop)
        requests = tuple(
            ValidatedRequest(
                request_id=request_id if params.best_of == 1 else f"{request_id}/{i}",
                input_ids=input_ids,
                sampling=replace(params.sampling, seed=seed),
                stopping=stopping,
                top_n_tokens=params.top_n_tokens,
                prefill_logprobs=request.decoder_input_details,
                deadline=deadline,
                adapter=request.adapter_id or "",
                grammar=params.grammar,
                images=images,
            )
            for i, seed in enumerate(params.seeds)
        )
        options = ResponseOptions(
            prompt=typed,
            input_length=len(input_ids),
            details=request.details,
            decoder_input_details=request.decoder_input_details,
            return_full_text=request.return_full_text,
            best_of=params.best_of,
        )
        return ValidatedGenerate(requests=requests, options=options)

    def _image_prompt(self, request: GenerateInput) -> GenerateInput:
        """The prompt's text with one image token per image, and its images in order: from
        input_chunks (gRPC), or from TGI's markdown images `![](url)` in inputs when the
        model takes images (a text model reads the markdown as text, as TGI does)."""
        pipeline = self.images
        if request.input_chunks:
            token = pipeline.image_text if pipeline is not None else ""
            text = "".join(c if isinstance(c, str) else token for c in request.input_chunks)
            refs = tuple(c for c in request.input_chunks if isinstance(c, ImageRef))
            if refs and pipeline is None:
                raise ImageError(refs[0].field, f"{refs[0].field}: this model takes no images "
                                 "(its snapshot has no image processor)")
            return replace(request, inputs=text, images=refs)
        if pipeline is None or request.images or request.prompt_ids is not None:
            return request
        text, refs = markdown_images(request.inputs, pipeline.image_text)
        return replace(request, inputs=text, images=refs) if refs else request
