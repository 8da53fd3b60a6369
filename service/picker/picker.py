"""The picker's decision for one request: ready replicas ranked by prefix affinity and load."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.picker.prefix_index import PrefixIndex, prefix_keys
from service.picker.replicas import Replica, ReplicaSet
from service.picker.scoring import Candidate, Weights, overloaded, rank


@dataclass(frozen=True)
class PickerConfig:
    """How prompts are keyed and replicas scored."""

    weights: Weights = field(default_factory=Weights)
    chunk_chars: int = 64  # characters per prefix-index chunk (a few tokens' worth)
    max_chunks: int = 512  # prompt characters looked at: chunk_chars * max_chunks
    # Characters per token, to size each replica's share of the index from its KV cache.
    chars_per_token: float = 4.0


class EndpointPicker:
    """Ranks the ready replicas for a prompt and remembers where each prefix went."""

    def __init__(self, replicas: ReplicaSet, config: PickerConfig | None = None) -> None:
        self.replicas = replicas
        self.config = config or PickerConfig()
        self.index = PrefixIndex()

    def forget(self, endpoint: str) -> None:
        """A replica's cache is gone (it came back after failing or draining)."""
        self.index.forget(endpoint)

    def _size_index(self, replica: Replica) -> None:
        load = replica.load
        if load is not None and load.block_size and load.num_blocks:
            tokens = load.block_size * load.num_blocks
            keys = int(tokens * self.config.chars_per_token / self.config.chunk_chars)
            self.index.set_capacity(replica.endpoint, keys)

    def pick(self, prompt: str | None, subset: set[str] | None = None) -> list[str]:
        """Ready replicas (within `subset` when given), best first; [] when none is ready.

        The first is counted as picked. Its prefix is recorded there unless the request was
        spilled away from a replica caching more of it (an overloaded home): the prefix keeps
        one home, and later requests go back to it once the imbalance is gone, instead of
        alternating between two caches that both have to hold it."""
        cfg = self.config
        keys = prefix_keys(prompt, cfg.chunk_chars, cfg.max_chunks) if prompt else []
        ready = [
            r for r in self.replicas.replicas
            if r.ready and (subset is None or r.endpoint in subset)
        ]  # fmt: skip
        by_endpoint = {r.endpoint: r for r in ready}
        candidates = []
        for r in ready:
            self._size_index(r)
            matched = self.index.matched(keys, r.endpoint) / len(keys) if keys else 0.0
            kv = r.load.kv_usage if r.load is not None else 0.0
            candidates.append(
                Candidate(
                    r.endpoint,
                    r.estimated_load(),
                    kv,
                    matched,
                    r.picks,
                    r.share(),
                    self.index.size(r.endpoint),
                )
            )
        order = rank(candidates, cfg.weights, len(keys))
        if order:
            chosen = by_endpoint[order[0]]
            chosen.picked()
            first = next(c for c in candidates if c.address == order[0])
            best = max(c.matched_fraction for c in candidates)
            spilled = first.matched_fraction < best and any(
                c.matched_fraction == best and overloaded(c, candidates, cfg.weights)
                for c in candidates
            )
            if keys and not spilled:
                self.index.record(keys, chosen.endpoint)
        return order
