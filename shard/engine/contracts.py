"""Typed step contracts of the shard: what the router asked for and what a step produced.

Plain dataclasses of ints, floats and strings; shard/server/convert.py is the only place that turns them
into or out of protobuf messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shard.engine.grammar import GrammarSpec
from shard.engine.sampling import SamplingParams
from shard.engine.stopping import StopReason


@dataclass(frozen=True)
class ImageSpec:
    """One preprocessed image of a request's prompt (see ImageInput in shard.proto)."""

    content_hash: bytes  # the encoder cache's key
    offset: int  # first placeholder position in input_ids
    length: int  # placeholder tokens = embedding rows of the image
    shape: tuple[int, ...]  # of pixel_values: [3, H, W] or [t, h, w, patch_dim] (Qwen2-VL)
    pixel_values: bytes  # float32, C order


@dataclass(frozen=True)
class RequestSpec:
    """One request's chunk in a Prefill step (see Request in shard.proto)."""

    id: int
    input_ids: list[int]
    cache_len: int
    chunk_len: int
    blocks: list[int]
    generated_len: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 16
    stop_sequences: list[str] = field(default_factory=list)
    ignore_eos_token: bool = False
    prefill_logprobs: bool = False
    top_n_tokens: int = 0
    adapter_id: str = ""  # LoRA adapter name; "" for the base model
    grammar: GrammarSpec | None = None  # constrained decoding; None: unconstrained
    # The router detokenizes and matches stop sequences itself: Generations carry empty texts,
    # stop_sequences are ignored here (EOS and max_new_tokens still finish the request).
    ids_only: bool = False
    # Images of the prompt (vision-language models); pixel values only for those overlapping
    # the chunk (the others give M-RoPE positions their place).
    images: tuple[ImageSpec, ...] = ()


@dataclass(frozen=True)
class BatchSpec:
    id: int
    requests: list[RequestSpec]


@dataclass(frozen=True)
class CachedBatchRef:
    id: int
    request_ids: list[int]


@dataclass(frozen=True)
class BlockGrant:
    request_id: int
    blocks: list[int]


@dataclass
class TokenList:
    """Index-aligned token ids, log-probabilities (NaN where unknown), texts and specialness."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    is_special: list[bool] = field(default_factory=list)


@dataclass(frozen=True)
class FinishedText:
    text: str
    generated_tokens: int
    finish_reason: StopReason
    seed: int | None


@dataclass
class Generation:
    request_id: int
    tokens: TokenList
    prefill_tokens: TokenList | None = None
    top_tokens: list[TokenList] = field(default_factory=list)
    finished: FinishedText | None = None


@dataclass
class StepTimings:
    prepare_ns: int = 0
    forward_ns: int = 0
    decode_ns: int = 0
    total_ns: int = 0


@dataclass(frozen=True)
class ExpertLoad:
    """Mixture-of-experts routing over a window of steps: routed (token, layer) pairs per
    expert, all MoE layers summed, and how many steps the window spans."""

    tokens_per_expert: list[int]
    steps: int


@dataclass
class StepResult:
    generations: list[Generation]
    batch: CachedBatchRef | None
    timings: StepTimings
    expert_load: ExpertLoad | None = None  # on the step that closes a window (MoE models)
