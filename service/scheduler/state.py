"""Request states and the scheduler's view of one sequence."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from service.scheduler.prefix_cache import ImageSpan
from service.scheduler.speculation import SpecState


class RequestState(enum.Enum):
    """Lifecycle of a sequence inside the scheduler (the one enum every layer uses)."""

    WAITING = "waiting"  # admitted; holds no KV blocks (new, or preempted and waiting to recompute)
    RUNNING = "running"  # holds KV blocks; prefilling (in chunks) or decoding one token per step
    FINISHED = "finished"  # the shard reported a finish reason; blocks freed
    ABORTED = "aborted"  # cancelled, deadline passed or failed; blocks freed


@dataclass(slots=True, eq=False)
class Sequence:
    """One request as the scheduler sees it: plain ints, no tensors, no protos.

    The one scheduling rule: `computed` (tokens whose K/V sit in `blocks`) catches up with
    `len(token_ids)` (every known token: prompt, then generated). A new request has
    len(token_ids) - computed = prompt length (prefill, in chunks); a decoding one has exactly 1
    (the last sampled token, whose K/V the next step writes); a prefix-cache hit just starts
    `computed` above 0.
    """

    seq_id: int  # router-wide unique id (shard Request.id)
    token_ids: list[int]  # prompt followed by generated tokens
    prompt_len: int
    arrival: int  # admission order; larger = younger
    prefill_logprobs: bool = False  # send prompt logprobs (forces cache_len 0) until sent once
    payload: Any = None  # engine data (sampling parameters ...), opaque to the scheduler
    state: RequestState = RequestState.WAITING
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    # Digest of each full, computed block of `blocks` (prefix-cache keys, chained).
    block_hashes: list[bytes] = field(default_factory=list)
    # True while the shard holds this request (between its first chunk and finish/filter).
    on_shard: bool = False
    # False from (re)admission until the step whose chunk completes the input.
    prefill_done: bool = False
    # Tokens the current step computes for it (set by schedule, consumed by apply_output).
    scheduled: int = 0
    # Tokens sampled for it by plans whose output has not arrived yet (overlap: 0 or 1 ahead).
    pending: int = 0
    # generated_len of the current (re)compute: tokens generated before the last preemption.
    recompute_generated: int = 0
    prefix_hit_tokens: int = 0  # cached prompt tokens at first admission
    preemptions: int = 0
    # LoRA adapter ("" for the base model): the shards hold at most max_adapters distinct
    # adapters at once, and its K/V only ever match prefix-cache blocks of the same salt.
    adapter: str = ""
    cache_salt: bytes = b""
    # Images of the prompt: their content hashes join the prefix-cache keys of the blocks
    # their placeholder tokens overlap (same text, different image: different K/V).
    images: tuple[ImageSpan, ...] = ()
    # Whether drafts may be proposed for it (False for grammar-constrained requests: every draft
    # position would need its own token mask).
    speculate: bool = True
    # Most tokens it may generate (max_new_tokens): drafts never run past it. 0: unknown.
    max_new_tokens: int = 0
    # Speculative decoding: the proposer's state (None when the router does not speculate) and
    # the drafts of the current step (set by schedule, consumed by apply_output).
    spec: SpecState | None = None
    drafts: list[int] = field(default_factory=list)

    @property
    def generated_len(self) -> int:
        return len(self.token_ids) - self.prompt_len
