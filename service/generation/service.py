"""The public API's domain object: admits, validates and runs client requests on the engine,
expands best_of, measures each request (metrics, one log line) — everything the servicer does
beyond decoding and encoding protos. No gRPC here.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from service.engine.adapters import AdapterInfo, AdapterSource
from service.engine.contracts import (
    DrainingError,
    Engine,
    Finished,
    FinishReason,
    OverloadedError,
    RequestStream,
    ShardUnavailableError,
    StepEvent,
    TokenInfo,
    ValidatedRequest,
)
from service.generation.errors import ValidationError, error_type
from service.generation.text_stream import RouterText
from service.generation.validation import (
    GenerateInput,
    ResponseOptions,
    ValidatedGenerate,
    Validator,
)
from service.observability.adapter_load import AdapterSlot
from service.observability.logs import REQUEST_LOGGER, log_request
from service.observability.metrics import RequestRecord, ServerMetrics
from service.observability.tracing import RequestTrace, Tracing

GENERATE = "generate"
GENERATE_STREAM = "generate_stream"
CHAT_COMPLETIONS = "chat_completions"
CHAT_COMPLETIONS_STREAM = "chat_completions_stream"
COMPLETIONS = "completions"
COMPLETIONS_STREAM = "completions_stream"
# A LoRA adapter's name: what requests and DELETE /info/loras/{name} carry (no '/').
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# The metrics' adapter label of requests naming no loaded adapter (not a valid adapter name).
UNKNOWN_ADAPTER = "<unknown>"


@dataclass(frozen=True)
class GeneratedSequence:
    """One finished sequence as the response reports it."""

    generated_text: str  # with the prompt prepended when return_full_text
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: tuple[TokenInfo, ...]
    tokens: tuple[TokenInfo, ...]
    top_tokens: tuple[tuple[TokenInfo, ...], ...]
    # Tokens received per engine step (speculative decoding); empty without --speculate.
    tokens_per_step: tuple[int, ...] = ()

    @property
    def logprob_sum(self) -> float:
        """Total log-probability of the generated tokens (unknown ones count 0)."""
        return math.fsum(t.logprob for t in self.tokens if not math.isnan(t.logprob))


@dataclass(frozen=True)
class RequestTimings:
    """Where a finished request's time went, in seconds (TGI's x-*-time headers)."""

    total_seconds: float  # arrival until the answer
    validation_seconds: float  # arrival until validated (tokenized, grammar compiled)
    queue_seconds: float  # validated until first scheduled
    inference_seconds: float  # first scheduled until finished


@dataclass(frozen=True)
class GenerateOutcome:
    """Result of a unary Generate: the best sequence and, for best_of > 1, the others."""

    best: GeneratedSequence
    others: tuple[GeneratedSequence, ...]
    options: ResponseOptions
    timings: RequestTimings | None = None


@dataclass(slots=True)
class StreamItem:
    """One event of a stream; `finished` and `generated_text` are set on the last."""

    index: int
    token: TokenInfo
    top_tokens: tuple[TokenInfo, ...]
    options: ResponseOptions
    generated_text: str | None = None
    finished: Finished | None = None
    # Events already queued behind this one (the stream's iterator yields them without
    # waiting): a writer that fell behind may take them now and send them in one message.
    backlog: int = 0


@dataclass
class _Timer:
    """Timings of one client request (time.monotonic seconds)."""

    start: float = field(default_factory=time.monotonic)
    validated: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    queue_seconds: float = 0.0
    inference_seconds: float = 0.0


@dataclass
class _Collector:
    """Accumulates one sequence's events."""

    prefill: tuple[TokenInfo, ...] = ()
    tokens: list[TokenInfo] = field(default_factory=list)
    top_tokens: list[tuple[TokenInfo, ...]] = field(default_factory=list)
    finished: Finished | None = None

    def add(self, event: StepEvent) -> None:
        if event.prefill is not None:
            self.prefill = event.prefill
        self.tokens.append(event.token)
        if event.top_tokens:
            self.top_tokens.append(event.top_tokens)
        if event.finished is not None:
            self.finished = event.finished

    def sequence(self, options: ResponseOptions) -> GeneratedSequence:
        finished = self.finished
        if finished is None:  # the engine ended the stream without a final event
            raise ShardUnavailableError("generation ended without a final token")
        text = visible_text(self.tokens)
        if options.return_full_text:
            text = options.prompt + text
        return GeneratedSequence(
            generated_text=text,
            finish_reason=finished.finish_reason,
            generated_tokens=finished.generated_tokens,
            seed=finished.seed,
            prefill=self.prefill,
            tokens=tuple(self.tokens),
            top_tokens=tuple(self.top_tokens),
            tokens_per_step=finished.tokens_per_step,
        )


class Admission(Protocol):
    """A limit on client requests in flight shared with other processes (the multi-process
    router's front ends): checked beside the service's own limit, at once, before validation."""

    def try_enter(self) -> bool:
        """Counts one more request in flight, or returns False when the limit is reached."""
        ...

    def leave(self) -> None:
        """Counts one request fewer (only after a successful try_enter)."""
        ...


class GenerationService:
    """Runs client requests on the engine within the router's limits."""

    def __init__(
        self,
        engine: Engine,
        validator: Validator,
        metrics: ServerMetrics,
        *,
        max_concurrent_requests: int,
        on_shard_failure: Callable[[], None] | None = None,
        logger: logging.Logger | None = None,
        admission: Admission | None = None,
        tracing: Tracing | None = None,
        text: RouterText | None = None,
    ) -> None:
        self.engine = engine
        self.validator = validator
        self.metrics = metrics
        self.max_concurrent_requests = max_concurrent_requests
        self._on_shard_failure = on_shard_failure
        self._log = logger or logging.getLogger(REQUEST_LOGGER)
        self._in_flight = 0
        self._draining = False
        self._admission = admission
        self._tracing = tracing
        # Set: requests run ids-only and their text is made here (--router-detokenize).
        self._text = text

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def start_draining(self) -> None:
        """Refuses new requests from now on (UNAVAILABLE); in-flight ones go on."""
        self._draining = True

    def _admit(self, method: str) -> None:
        self.metrics.request_count.labels(method).inc()
        if self._draining:
            raise DrainingError("the server is shutting down and accepts no new requests")
        if self._in_flight >= self.max_concurrent_requests or (
            self._admission is not None and not self._admission.try_enter()
        ):
            raise OverloadedError(
                f"too many requests in flight: the limit is {self.max_concurrent_requests} "
                f"(--max-concurrent-requests)"
            )
        self._in_flight += 1
        self.metrics.in_flight.set(self._in_flight)

    def _release(self) -> None:
        if self._admission is not None:
            self._admission.leave()
        self._in_flight -= 1
        self.metrics.in_flight.set(self._in_flight)

    def _submit(self, request: ValidatedRequest) -> RequestStream:
        text = self._text
        if text is not None:
            request = replace(request, ids_only=True)
        try:
            stream = self.engine.submit(request)
        except ShardUnavailableError:
            self._shard_failed()
            raise
        return stream if text is None else text.wrap(request, stream)

    # --- LoRA adapters --------------------------------------------------------------------------
    def adapters(self) -> list[AdapterInfo]:
        """The loaded adapters, in load order."""
        return self.engine.list_adapters()

    async def load_adapters(self, sources: list[AdapterSource]) -> list[AdapterInfo]:
        """Loads adapters on every shard, all or none; ValidationError for malformed entries."""
        if not sources:
            raise ValidationError("adapters", "adapters must name at least one {name, path}")
        for i, source in enumerate(sources):
            if not ADAPTER_NAME.match(source.name):
                raise ValidationError(
                    f"adapters[{i}].name",
                    f"adapters[{i}].name must be 1-128 of [A-Za-z0-9._-] starting with a letter "
                    f"or digit; got {source.name!r}",
                )
            if not source.path:
                raise ValidationError(f"adapters[{i}].path", f"adapters[{i}].path must not be "
                                      "empty (a PEFT adapter directory or a hub id)")
        t0 = time.monotonic()
        loaded = await self.engine.load_adapters(sources)
        self._log.info("adapters loaded", extra={"fields": {
            "adapters": ",".join(a.name for a in loaded),
            "load_ms": round((time.monotonic() - t0) * 1e3, 3)}})  # fmt: skip
        return loaded

    async def unload_adapter(self, name: str) -> None:
        """Unloads an adapter once the requests already admitted with it have finished."""
        t0 = time.monotonic()
        await self.engine.unload_adapter(name)
        self.metrics.forget_adapter(name)
        self._log.info("adapter unloaded", extra={"fields": {
            "adapter": name, "unload_ms": round((time.monotonic() - t0) * 1e3, 3)}})  # fmt: skip

    def _shard_failed(self) -> None:
        if self._on_shard_failure is not None:
            self._on_shard_failure()

    def _observe_token(self, timer: _Timer) -> None:
        now = time.monotonic()
        if timer.first_token is None:
            timer.first_token = now
            self.metrics.time_to_first_token.observe(now - timer.start)
        elif timer.last_token is not None:
            self.metrics.inter_token_latency.observe(now - timer.last_token)
        timer.last_token = now

    async def _run_one(
        self, request: ValidatedRequest, timer: _Timer, adapter: AdapterSlot | None = None
    ) -> _Collector:
        collector = _Collector()
        stream = self._submit(request)
        sequence_timer = _Timer(start=timer.start)
        try:
            async for event in stream:
                if adapter is not None:
                    adapter.start()
                self._observe_token(sequence_timer)
                collector.add(event)
                if event.finished is not None:
                    break
        except ShardUnavailableError:
            self._shard_failed()
            raise
        finally:
            if collector.finished is None:
                stream.cancel()
        timer.first_token = timer.first_token or sequence_timer.first_token
        if sequence_timer.last_token is not None:
            timer.last_token = max(timer.last_token or 0.0, sequence_timer.last_token)
        return collector

    async def generate(
        self,
        request: GenerateInput,
        *,
        request_id: str,
        deadline: float | None = None,
        method: str = GENERATE,
    ) -> GenerateOutcome:
        """Generates the whole completion (best_of sequences, best first). `method`: the route's
        label in metrics and logs."""
        timer = _Timer()
        self._admit(method)
        adapter = self.metrics.adapter_load.enter(request.adapter_id or "")
        trace = self._tracing.begin(method, request_id) if self._tracing is not None else None
        options: ResponseOptions | None = None
        outcome: GenerateOutcome | None = None
        max_new_tokens = 0
        try:
            validated = await self.validator.validate(
                request, request_id=request_id, stream=False, deadline=deadline
            )
            timer.validated = time.monotonic()
            if trace is not None and trace.traceparent is not None:
                validated = _traced(validated, trace.traceparent)
            options = validated.options
            max_new_tokens = validated.requests[0].stopping.max_new_tokens
            if len(validated.requests) == 1:
                collectors = [await self._run_one(validated.requests[0], timer, adapter)]
            else:
                async with asyncio.TaskGroup() as group:
                    tasks = [
                        group.create_task(self._run_one(r, timer, adapter))
                        for r in validated.requests
                    ]
                collectors = [t.result() for t in tasks]
            sequences = sorted(
                (c.sequence(options) for c in collectors), key=lambda s: s.logprob_sum, reverse=True
            )
            for c in collectors:
                assert c.finished is not None
                timer.queue_seconds = max(timer.queue_seconds, c.finished.queue_seconds)
                timer.inference_seconds = max(timer.inference_seconds, c.finished.inference_seconds)
            now = time.monotonic()
            timings = RequestTimings(
                total_seconds=now - timer.start,
                validation_seconds=(timer.validated or now) - timer.start,
                queue_seconds=timer.queue_seconds,
                inference_seconds=timer.inference_seconds,
            )
            outcome = GenerateOutcome(
                best=sequences[0], others=tuple(sequences[1:]), options=options, timings=timings
            )
            return outcome
        except BaseException as error:  # noqa: BLE001 - recorded, then re-raised
            self._record_failure(method, request_id, timer, options, _unwrap(error),
                                 adapter=request.adapter_id or "")
            if trace is not None:
                _finish_trace(trace, timer, options, stream=False, error=_unwrap(error))
            raise _unwrap(error) from None
        finally:
            self._release()
            adapter.leave()
            if outcome is not None:
                if trace is not None:
                    _finish_trace(
                        trace,
                        timer,
                        outcome.options,
                        stream=False,
                        generated_tokens=outcome.best.generated_tokens,
                        finish_reason=outcome.best.finish_reason.value,
                    )
                self._record_success(
                    method,
                    request_id,
                    timer,
                    outcome.options,
                    generated_tokens=sum(
                        s.generated_tokens for s in (outcome.best, *outcome.others)
                    ),
                    finish_reason=outcome.best.finish_reason,
                    max_new_tokens=max_new_tokens,
                    adapter=request.adapter_id or "",
                )

    async def stream(
        self,
        request: GenerateInput,
        *,
        request_id: str,
        deadline: float | None = None,
        method: str = GENERATE_STREAM,
    ) -> AsyncIterator[StreamItem]:
        """Yields one item per generated token as soon as the engine produces it. Errors before
        the first item mean nothing was generated; the caller reports later ones in band."""
        timer = _Timer()
        self._admit(method)
        adapter = self.metrics.adapter_load.enter(request.adapter_id or "")
        trace = self._tracing.begin(method, request_id) if self._tracing is not None else None
        options: ResponseOptions | None = None
        finished: Finished | None = None
        index = 0
        texts: list[str] = []
        # Inter-token gaps, observed in one batch when the stream ends (hot path: no histogram
        # update per token); the first token's latency is observed at once.
        gaps: list[float] = []
        monotonic = time.monotonic
        last = 0.0
        try:
            validated = await self.validator.validate(
                request, request_id=request_id, stream=True, deadline=deadline
            )
            timer.validated = time.monotonic()
            if trace is not None and trace.traceparent is not None:
                validated = _traced(validated, trace.traceparent)
            options = validated.options
            engine_stream = self._submit(validated.requests[0])
            try:
                async for event in engine_stream:
                    now = monotonic()
                    if index:
                        gaps.append(now - last)
                    else:
                        timer.first_token = now
                        self.metrics.time_to_first_token.observe(now - timer.start)
                        adapter.start()
                    last = now
                    token = event.token
                    if not token.special:
                        texts.append(token.text)
                    finished = event.finished
                    if finished is None:
                        yield StreamItem(index, token, event.top_tokens, options, None, None,
                                         engine_stream.ready())  # fmt: skip
                        index += 1
                        continue
                    text = "".join(texts)
                    if options.return_full_text:
                        text = options.prompt + text
                    yield StreamItem(index, token, event.top_tokens, options, text, finished)
                    index += 1
                    break
                if finished is None:
                    raise ShardUnavailableError("generation ended without a final token")
            except ShardUnavailableError:
                self._shard_failed()
                raise
            finally:
                if finished is None:
                    engine_stream.cancel()
        except BaseException as error:
            if gaps:
                self.metrics.observe_inter_token_latencies(gaps)
            timer.last_token = last or None
            self._record_failure(method, request_id, timer, options, error, index,
                                 adapter=request.adapter_id or "")
            if trace is not None:
                _finish_trace(trace, timer, options, stream=True, error=error)
            raise
        finally:
            self._release()
            adapter.leave()
        if gaps:
            self.metrics.observe_inter_token_latencies(gaps)
        timer.last_token = last
        timer.queue_seconds = finished.queue_seconds
        timer.inference_seconds = finished.inference_seconds
        if trace is not None:
            _finish_trace(
                trace,
                timer,
                options,
                stream=True,
                generated_tokens=finished.generated_tokens,
                finish_reason=finished.finish_reason.value,
            )
        self._record_success(
            method,
            request_id,
            timer,
            options,
            generated_tokens=finished.generated_tokens,
            finish_reason=finished.finish_reason,
            max_new_tokens=validated.requests[0].stopping.max_new_tokens,
            adapter=request.adapter_id or "",
        )

    def _record_success(
        self,
        method: str,
        request_id: str,
        timer: _Timer,
        options: ResponseOptions,
        *,
        generated_tokens: int,
        finish_reason: FinishReason,
        max_new_tokens: int,
        adapter: str = "",
    ) -> None:
        end = time.monotonic()
        validated = timer.validated or end
        record = RequestRecord(
            method=method,
            total_seconds=end - timer.start,
            validation_seconds=validated - timer.start,
            queue_seconds=timer.queue_seconds,
            inference_seconds=timer.inference_seconds,
            input_tokens=options.input_length,
            generated_tokens=generated_tokens,
            max_new_tokens=max_new_tokens,
        )
        self.metrics.observe_success(record)
        self.metrics.observe_adapter(
            self._adapter_label(adapter), "ok", record.input_tokens, generated_tokens
        )
        log_request(
            self._log,
            "request finished",
            logging.INFO,
            request_id=request_id,
            method=method,
            status="ok",
            **({"adapter": adapter} if adapter else {}),
            input_tokens=record.input_tokens,
            generated_tokens=generated_tokens,
            finish_reason=finish_reason.value,
            best_of=options.best_of,
            total_ms=round(record.total_seconds * 1e3, 3),
            validation_ms=round(record.validation_seconds * 1e3, 3),
            queue_ms=round(record.queue_seconds * 1e3, 3),
            inference_ms=round(record.inference_seconds * 1e3, 3),
            time_to_first_token_ms=_ms(timer.first_token, timer.start),
        )

    def _adapter_label(self, adapter: str) -> str:
        """The adapter label a finished request is counted under. Only adapters loaded now
        become label values: names clients make up must not grow the metric's label sets, and
        a request finishing while its adapter unloads must not bring back the series the unload
        dropped (forget_adapter)."""
        if adapter and adapter not in {a.name for a in self.engine.list_adapters()}:
            return UNKNOWN_ADAPTER
        return adapter

    def _record_failure(
        self,
        method: str,
        request_id: str,
        timer: _Timer,
        options: ResponseOptions | None,
        error: BaseException,
        events_sent: int = 0,
        adapter: str = "",
    ) -> None:
        if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
            reason, message, level = "cancelled", "client cancelled", logging.INFO
        else:
            reason = error_type(error)
            message = str(error) or type(error).__name__
            level = logging.INFO if reason == "validation" else logging.WARNING
        self.metrics.observe_failure(method, reason)
        self.metrics.observe_adapter(self._adapter_label(adapter), reason)
        log_request(
            self._log,
            "request failed",
            level,
            request_id=request_id,
            method=method,
            status=reason,
            **({"adapter": adapter} if adapter else {}),
            error=message,
            input_tokens=options.input_length if options else None,
            events_sent=events_sent,
            total_ms=round((time.monotonic() - timer.start) * 1e3, 3),
            time_to_first_token_ms=_ms(timer.first_token, timer.start),
        )


def visible_text(tokens: list[TokenInfo]) -> str:
    """generated_text: the tokens' incremental texts without special tokens (BOS, EOS, PAD), as
    in TGI. Built from the same texts a stream sends, so a stream's concatenated non-special
    token texts always equal the unary generated_text."""
    return "".join(t.text for t in tokens if not t.special)


def _ms(end: float | None, start: float) -> float | None:
    return None if end is None else round((end - start) * 1e3, 3)


def _traced(validated: ValidatedGenerate, traceparent: str) -> ValidatedGenerate:
    """The requests carrying the request span's traceparent to the shards."""
    return replace(
        validated, requests=tuple(replace(r, traceparent=traceparent) for r in validated.requests)
    )


def _finish_trace(
    trace: RequestTrace,
    timer: _Timer,
    options: ResponseOptions | None,
    *,
    stream: bool,
    generated_tokens: int | None = None,
    finish_reason: str | None = None,
    error: BaseException | None = None,
) -> None:
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        error = None  # the client went away: not a failure of the request
    trace.finish(
        start=timer.start,
        validated=timer.validated,
        queue_seconds=timer.queue_seconds,
        first_token=timer.first_token,
        last_token=timer.last_token,
        stream=stream,
        attributes={
            "tokenwire.input_tokens": options.input_length if options else None,
            "tokenwire.generated_tokens": generated_tokens,
            "tokenwire.finish_reason": finish_reason,
        },
        error=error,
    )


def _unwrap(error: BaseException) -> BaseException:
    """The first real error of a TaskGroup failure (best_of), else the error itself."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


@dataclass(frozen=True)
class ServerInfo:
    """What Info reports: the model, the shards and the router's limits."""

    model_id: str
    model_sha: str | None
    model_dtype: str
    model_device_type: str
    model_pipeline_tag: str | None
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    validation_workers: int
    max_client_batch_size: int
    version: str
    max_top_n_tokens: int
    max_batch_total_tokens: int
    block_size: int
    num_kv_blocks: int
    num_shard: int
    speculate: int = 0  # --speculate (0: off)
    model_impl: str = ""  # "native" | "transformers": which code serves the model
    cuda_graphs: bool = False  # decode steps replay CUDA graphs
    router: str = "tokenwire-router"
    max_loras: int = 0  # LoRA adapter device slots of the shards (0: LoRA off)
    max_lora_rank: int = 0
    sha: str | None = None
    docker_label: str | None = None
    # The scheduler's batch limits (TGI's /info fields of the same names).
    max_batch_size: int | None = None
    waiting_served_ratio: float = 0.0
    max_waiting_tokens: int = 0
