"""Contract between the public servicer and the generation engine (scheduler + shard client).

The servicer validates a proto request into a `ValidatedRequest`, submits it to the `Engine`, and
turns the `StepEvent`s it receives into proto responses. Plain dataclasses: no gRPC, no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

# The step vocabulary lives with the scheduler (the lower layer); re-exported for the API side.
from service.scheduler.contracts import FinishReason, TokenInfo


@dataclass(frozen=True)
class SamplingConfig:
    """Normalised sampling parameters (off values: temperature 1, top_k 0, top_p 1, typical_p 1,
    repetition_penalty 1, frequency_penalty 0). `seed` is always set (drawn when the client gave
    none) and only matters when `do_sample`."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    watermark: bool = False
    seed: int = 0


@dataclass(frozen=True)
class StoppingConfig:
    """When generation stops."""

    max_new_tokens: int
    stop_sequences: tuple[str, ...] = ()
    ignore_eos_token: bool = False


@dataclass(frozen=True)
class GrammarSpec:
    """A compiled-and-checked output constraint, as the shards receive it (OutputGrammar).

    kind: "json_schema" (source: the schema as JSON text, with llguidance's options under
    "x-guidance"), "regex" or "lark" (llguidance's Lark dialect: tool calls).
    """

    kind: str
    source: str


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image of a prompt: its pixel values (the model's own transformers image
    processor's output) and where its placeholder tokens sit in input_ids."""

    # sha256 of the encoded image (a tile's: of it and the tile index): encoder-cache and
    # prefix-cache key
    content_hash: bytes
    offset: int  # first placeholder token of the image in input_ids
    length: int  # placeholder tokens (the count the processor expands the image to)
    pixel_values: bytes  # float32, C order
    # of pixel_values: [3, H, W] (LLaVA; an Idefics3 tile), [t, h, w, patch_dim] (Qwen2-VL)
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ValidatedRequest:
    """One sequence to generate, after validation and tokenization (best_of is expanded by the
    servicer into several of these with different seeds)."""

    request_id: str  # x-request-id, for logs and metrics
    input_ids: tuple[int, ...]  # prompt tokens after truncation
    sampling: SamplingConfig
    stopping: StoppingConfig
    top_n_tokens: int = 0
    prefill_logprobs: bool = False  # decoder_input_details
    deadline: float | None = None  # time.monotonic() instant after which it is dropped
    adapter: str = ""  # LoRA adapter name; "" for the base model
    grammar: GrammarSpec | None = None  # constrained decoding; None: unconstrained
    # W3C traceparent of the request's span when it is traced (the shards' step spans join it).
    traceparent: str | None = None
    # The caller turns the tokens into text and matches stop sequences itself (the router's
    # front ends: service.generation.text_stream): the shards return ids only, the events'
    # texts are empty and stop sequences never finish the request in the engine.
    ids_only: bool = False
    # Images of the prompt, in placeholder order (vision-language models); () for text only.
    images: tuple[ImageInput, ...] = ()


@dataclass(frozen=True)
class Finished:
    """Final state of a sequence."""

    generated_text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int | None  # None for greedy requests
    queue_seconds: float = 0.0  # admission until the first scheduled step
    inference_seconds: float = 0.0  # first scheduled step until finished
    prefix_cache_hit_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # Tokens the sequence received from each step (speculative decoding); empty when the engine
    # does not speculate.
    tokens_per_step: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepEvent:
    """What one engine step produced for one request: one token; on the step that completes the
    prefill, the prompt tokens too (when asked); on the last, `finished`."""

    token: TokenInfo
    top_tokens: tuple[TokenInfo, ...] = ()
    prefill: tuple[TokenInfo, ...] | None = None
    finished: Finished | None = None


class EngineError(Exception):
    """Base of errors the engine raises to the servicer; the interceptor maps them to codes."""


class OverloadedError(EngineError):
    """Admission refused: too many requests in flight (RESOURCE_EXHAUSTED)."""


class ShardUnavailableError(EngineError):
    """A shard failed or is unreachable (UNAVAILABLE)."""


class DeadlineExceededError(EngineError):
    """The request's deadline passed before it finished (DEADLINE_EXCEEDED)."""


class DrainingError(EngineError):
    """The server is shutting down and admits nothing new (UNAVAILABLE)."""


class RequestStream(Protocol):
    """Events of one submitted request. Iterating yields StepEvents until one with `finished`;
    a failure raises an EngineError from the iterator. `cancel()` (or abandoning the iterator via
    `aclose()`) removes the request at the next step and frees its KV blocks."""

    def __aiter__(self) -> AsyncIterator[StepEvent]: ...

    def cancel(self) -> None: ...

    def stop(self) -> None:
        """Ends the request as finished by a stop sequence the caller matched (ids-only
        requests, whose text the caller makes): removed at the next step boundary like
        `cancel` (KV blocks freed), then one last event with `finished` ends the stream: its
        token is a placeholder (id -1) to drop, its `finished` the engine's accounting
        (timings, prefix-cache hits, tokens per step) of every token generated until then."""
        ...

    def ready(self) -> int:
        """Events received and not yet taken: the iterator yields that many without waiting
        (a stream's writer that fell behind coalesces them into one message)."""
        ...


# Upper bounds of tokenwire_moe_expert_load_ratio's buckets: an expert's share of a window's routed
# tokens times the number of experts (1.0: exactly its fair share; 0: never chosen).
EXPERT_LOAD_BOUNDS = (0.0, 0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0)


@dataclass
class ExpertLoadHistogram:
    """Load imbalance of a mixture-of-experts model: one observation per expert and window of
    shard steps (its share of the window's routed tokens x the number of experts), in buckets
    of EXPERT_LOAD_BOUNDS (counts[i]: observations <= bound i and above bound i - 1; the last
    entry: above every bound)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(EXPERT_LOAD_BOUNDS) + 1))
    total: float = 0.0  # sum of the observed ratios
    windows: int = 0

    def observe(self, tokens_per_expert: tuple[int, ...]) -> None:
        routed = sum(tokens_per_expert)
        if not routed:
            return
        n = len(tokens_per_expert)
        for t in tokens_per_expert:
            ratio = t * n / routed
            self.counts[bisect.bisect_left(EXPERT_LOAD_BOUNDS, ratio)] += 1
            self.total += ratio
        self.windows += 1


@dataclass
class EngineStats:
    """Live counters the servicer exposes (metrics, Info)."""

    queued: int = 0  # admitted, waiting for their first step
    running: int = 0  # holding KV blocks
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0  # free or evictable (cached prefix blocks no request uses)
    block_size: int = 0  # tokens per KV block
    last_batch_size: int = 0  # requests in the last step
    steps: int = 0  # steps run since start
    prefill_tokens_computed: int = 0  # prompt tokens computed (not served by the prefix cache)
    prefix_cache_hit_tokens: int = 0  # prompt tokens served by the prefix cache
    preemptions: int = 0  # requests preempted (freed, recomputed later)
    aborted: int = 0  # requests removed before they finished (cancel, deadline, shard failure)
    extra: dict[str, float] = field(default_factory=dict)
    spec_proposed_tokens: int = 0  # draft tokens sent to the shards (speculative decoding)
    spec_accepted_tokens: int = 0  # draft tokens accepted
    # spec_step_tokens[n]: sequence-steps with drafts that gave their sequence n tokens.
    spec_step_tokens: tuple[int, ...] = ()
    # MoE models: per-expert load of each routing window the shards reported (a copy)
    expert_load: ExpertLoadHistogram | None = None


@dataclass(frozen=True)
class AdapterSource:
    """A LoRA adapter to load: its name and where the shards read it (directory or hub id)."""

    name: str
    path: str
    revision: str | None = None


@dataclass(frozen=True)
class AdapterInfo:
    """A loaded LoRA adapter (as the shards reported it)."""

    name: str
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]


class Engine(Protocol):
    """The generation engine as the servicer sees it: `LocalEngine` (service.engine.engine) runs
    it in this process, `RemoteEngine` (service.app.remote_engine) reaches one in another."""

    def submit(self, request: ValidatedRequest) -> RequestStream:
        """Admits a request or raises OverloadedError / DrainingError / ShardUnavailableError."""
        ...

    def stats(self) -> EngineStats: ...

    def list_adapters(self) -> list[AdapterInfo]:
        """The LoRA adapters requests may name now."""
        ...

    async def load_adapters(self, sources: list[AdapterSource]) -> list[AdapterInfo]:
        """Loads LoRA adapters on the shards, all or none (see service.engine.adapters)."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Unloads a LoRA adapter after the requests admitted with it finish."""
        ...
