"""Speculative decoding, router side: n-gram prompt-lookup drafts and when to send them.

The router proposes because it owns the KV blocks: a draft of k tokens needs slots for k more
positions, granted before the step, and the blocks that end up holding only rejected K/V go back
after it (service/scheduler/scheduler.py: `_add_drafts`, `_settle_drafts`). The shard verifies
the drafts in the step's forward pass and emits 1..k+1 tokens (shard/engine/batches.py).

The proposer (prompt lookup): take the sequence's last n tokens (n = max_ngram down to
min_ngram), find their latest earlier occurrence in prompt + output, and propose the tokens that
followed it. When the continuation runs into the end of the sequence the match is periodic (the
text repeats with period L - i), so the proposal keeps cycling through that period. Each sequence
keeps an incremental index (n-gram -> latest continuation start) so a step costs O(new tokens),
not O(length).

Adaptive: no drafts in a step with more than `max_batch_size` running requests (a large batch is
compute-bound: verifying drafts costs what they save), and none for a sequence whose recent
acceptance fell below `min_acceptance` (it backs off for `cooldown_steps` steps, then tries again).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculationConfig:
    num_tokens: int = 0  # --speculate: most draft tokens per sequence and step (0: off)
    max_batch_size: int = 16  # --speculate-max-batch-size: no drafts in larger steps
    max_ngram: int = 3
    min_ngram: int = 1
    min_acceptance: float = 0.3  # back off when the accepted fraction's average drops below
    cooldown_steps: int = 8  # steps a backed-off sequence proposes nothing
    ema_weight: float = 0.3  # weight of the newest step in the acceptance average

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"speculate must be >= 0, got {self.num_tokens}")
        if self.max_batch_size < 1:
            raise ValueError(f"speculate max batch size must be >= 1, got {self.max_batch_size}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0


class NgramIndex:
    """Latest continuation start of every n-gram (min_n..max_n) of one growing token list.

    `_starts[n][key] = i` means tokens[i - n:i] is the n-gram of `key`, with i the largest such
    index below the list's current last position (so the continuation tokens[i] exists).

    Keys are ints, not tuples: the n-gram's tokens (ids < 2**32, as the shard protocol's uint32)
    packed 32 bits each, the last token in the lowest bits. Ints and dicts holding only ints are
    not tracked by the garbage collector, so indexing a long prompt (3 entries per token) adds
    nothing for the collector to scan, and no tuple is built per entry."""

    __slots__ = ("_indexed", "_max_n", "_min_n", "_starts")

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        self._max_n = max_n
        self._min_n = min_n
        self._starts: dict[int, dict[int, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._indexed = 0  # continuation starts 1.._indexed are in the index

    def _extend(self, tokens: list[int]) -> None:
        last = len(tokens) - 1  # a continuation must start before the last token's position + 1
        starts = self._starts
        min_n, max_n = self._min_n, self._max_n
        for i in range(self._indexed + 1, last + 1):
            key = 0
            for n in range(1, min(max_n, i) + 1):  # key of tokens[i - n:i], growing leftwards
                key |= tokens[i - n] << (32 * (n - 1))
                if n >= min_n:
                    starts[n][key] = i
        self._indexed = max(self._indexed, last)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens guessed to follow `tokens` (empty when no n-gram matches)."""
        if k <= 0:
            return []
        self._extend(tokens)
        length = len(tokens)
        top = min(self._max_n, length)
        keys = [0] * (top + 1)  # keys[n]: key of the last n tokens
        for n in range(1, top + 1):
            keys[n] = keys[n - 1] | tokens[length - n] << (32 * (n - 1))
        for n in range(top, self._min_n - 1, -1):
            i = self._starts[n].get(keys[n])
            if i is None:
                continue
            period = length - i  # >= 1: i <= length - 1
            return [tokens[i + (j % period)] for j in range(k)]
        return []


@dataclass(slots=True)
class SpecState:
    """One sequence's proposer and acceptance history."""

    index: NgramIndex
    acceptance: float = 1.0  # moving average of accepted / proposed per step
    cooldown: int = 0  # steps left without drafts
    proposed: int = 0  # totals for this sequence
    accepted: int = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k drafts; none while backed off (each call counts one step of the cooldown)."""
        if self.cooldown > 0:
            self.cooldown -= 1
            return []
        return self.index.propose(tokens, k)

    def record(self, proposed: int, accepted: int, cfg: SpeculationConfig) -> None:
        """Updates the average after a step that verified `proposed` drafts."""
        self.proposed += proposed
        self.accepted += accepted
        w = cfg.ema_weight
        self.acceptance = (1 - w) * self.acceptance + w * (accepted / proposed)
        if self.acceptance < cfg.min_acceptance:
            self.cooldown = cfg.cooldown_steps
            # Retry from the threshold: one good step keeps it on, one bad one backs off again.
            self.acceptance = cfg.min_acceptance


def new_spec_state(cfg: SpeculationConfig) -> SpecState:
    return SpecState(NgramIndex(cfg.max_ngram, cfg.min_ngram))
