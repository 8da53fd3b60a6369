"""Typed step contracts: what the scheduler decided, what the shard returned.

Lists of ints and small dataclasses only; `service.shard_client.convert` turns them into protos and back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.Enum):
    """Why a sequence stopped; `value` is the spelling of TGI's REST API."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"


@dataclass(frozen=True)
class TokenInfo:
    """A token with its incremental text and log-probability (NaN where unknown)."""

    id: int
    text: str
    logprob: float
    special: bool = False


@dataclass(slots=True)
class ChunkWork:
    """One request's prefill chunk in a step (shard Request)."""

    seq_id: int
    # Every token the cache must hold before sampling (prompt + generated). The scheduler's own
    # list: valid until apply_output (convert it before).
    input_ids: list[int]
    cache_len: int  # tokens already in the request's blocks; computation starts here
    chunk_len: int  # tokens computed this step
    blocks: list[int]  # full block table, covering cache_len + chunk_len tokens
    generated_len: int  # trailing input_ids generated before a preemption
    prefill_logprobs: bool
    payload: object  # engine data for the request (sampling, stopping), opaque here


@dataclass(slots=True)
class StepPlan:
    """What one step runs. Chunk work → a Prefill RPC fused with `decode_ids`; else Decode."""

    chunks: list[ChunkWork] = field(default_factory=list)
    decode_ids: list[int] = field(default_factory=list)  # requests decoding one token
    # Blocks appended this step to decoding requests: (request id, block ids).
    grants: list[tuple[int, list[int]]] = field(default_factory=list)
    # Requests the shard must forget before the step (preempted/aborted while on the shard).
    removed_from_shard: list[int] = field(default_factory=list)
    # Every request on the shard after the removals (the FilterBatch keep list).
    keep_ids: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    # Draft tokens to verify for decoding requests (speculative decoding): (request id, tokens).
    # Their positions' blocks are in `grants`; the request computes 1 + len(tokens) tokens.
    drafts: list[tuple[int, list[int]]] = field(default_factory=list)
    # Requests on the shard that reach max_new_tokens in the step still in flight (a plan made
    # one step ahead): they compute nothing more and are left out of the step's batch.
    finishing: list[int] = field(default_factory=list)

    @property
    def is_prefill(self) -> bool:
        return bool(self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.decode_ids

    @property
    def batch_size(self) -> int:
        return len(self.chunks) + len(self.decode_ids)


@dataclass(slots=True)
class FinishInfo:
    """Shard's final word on a request (GeneratedText)."""

    reason: FinishReason
    text: str
    generated_tokens: int
    seed: int | None


@dataclass(slots=True)
class GenerationOut:
    """What one request produced in one step (shard Generation): `token`, then, when the step
    verified drafts, the further accepted tokens in `more` (each with its alternatives)."""

    seq_id: int
    token: TokenInfo
    top_tokens: tuple[TokenInfo, ...] = ()
    prefill: tuple[TokenInfo, ...] | None = None
    finish: FinishInfo | None = None
    # Tokens after `token` from the same step (speculative decoding), in order, with their
    # top-n alternatives (empty tuples when none were asked for).
    more: tuple[tuple[TokenInfo, tuple[TokenInfo, ...]], ...] = ()

    @property
    def num_tokens(self) -> int:
        return 1 + len(self.more)


@dataclass(slots=True)
class StepOutput:
    """Result of one step as the scheduler consumes it."""

    generations: list[GenerationOut]
    batch_id: int | None  # the shard's merged cached batch; None when it is empty
    batch_request_ids: list[int] = field(default_factory=list)  # its requests
    forward_ns: int = 0
    # MoE models, on the step that closes the shard's routing window: routed (token, layer)
    # pairs per expert over the window (index: expert id); None otherwise.
    expert_load: tuple[int, ...] | None = None
