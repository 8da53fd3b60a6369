"""How the picker ranks replicas for one request: prefix affinity first, load only beyond a clear
imbalance.

Each ready replica gets a score (higher is better), in the spirit of GIE's scorers:

    score = prefix_weight * matched_fraction      (prompt chunks probably cached there, 0..1)
          + queue_weight  * (1 - load / (max_load + 1))   (load: waiting + running requests)
          + kv_weight     * (1 - kv_cache_usage)
          + spread_weight * (max_cached - cached) / (max_cached - min_cached + chunks + 1)
                                (cached: prefix-index entries; chunks: the request's own)

The prefix weight (5) outweighs the three others together (at most 3), so a request whose
prompt is cached on a replica goes there, consistently, as long as that replica is not clearly
overloaded. Two guards take the affinity credit away, so that hot prefixes cannot pile requests
on one replica: its load exceeds the least-loaded replica's by more than `balance_slack` requests
(SGLang's cache-aware router has the same escape), or its recent share of the picks exceeds
`max_share` times the mean (bounded-load affinity, as in consistent hashing with bounded loads),
counted only once the mean is `min_share_picks` or more so that a few picks' noise does not
count. The spread term places new prefixes (no affinity anywhere) on the replicas whose caches
hold the least prompt text, so shared prompts end up evenly spread over the caches: a replica
one such prompt behind the fullest gets about half its weight, and the instantaneous queue and
KV terms (1 each) only decide between replicas holding about as much. Ties go to the
lower load, then to the replica picked least often. The result is every ready replica, best
first: the first is the destination, the rest are the fallbacks Envoy retries in order.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Weights:
    """Weights of the score's terms and the imbalance guards."""

    prefix: float = 5.0
    queue: float = 1.0
    kv: float = 1.0
    balance_slack: float = 32.0  # requests (SGLang's cache-aware router uses 32 too)
    spread: float = 2.0
    max_share: float = 1.5  # times the mean recent share
    min_share_picks: float = 50.0  # below this mean, shares are noise


@dataclass(frozen=True)
class Candidate:
    """One ready replica as the scorer sees it."""

    address: str  # ip:port, as Envoy names the endpoint
    load: float  # waiting + running requests, plus picks not yet visible in its metrics
    kv_usage: float  # fraction of KV blocks held by requests, 0..1
    matched_fraction: float  # share of the request's prompt chunks it probably caches, 0..1
    picks: int = 0  # requests sent there so far (last tie-break)
    share: float = 0.0  # recent picks (decayed over ~10 s)
    cached: int = 0  # prefix-index entries: how much prompt text its cache probably holds


def overloaded(c: Candidate, candidates: list[Candidate], weights: Weights) -> bool:
    """Whether `c` is clearly more loaded than the others (it then gets no affinity credit)."""
    min_load = min(x.load for x in candidates)
    mean_share = sum(x.share for x in candidates) / len(candidates)
    return c.load - min_load > weights.balance_slack or (
        mean_share >= weights.min_share_picks and c.share > weights.max_share * mean_share
    )


def rank(candidates: list[Candidate], weights: Weights, chunks: int = 0) -> list[str]:
    """Addresses of `candidates`, best first, for a request whose prompt has `chunks` chunks."""
    if not candidates:
        return []
    max_load = max(c.load for c in candidates)
    max_cached = max(c.cached for c in candidates)
    cached_spread = max_cached - min(c.cached for c in candidates) + chunks + 1

    def score(c: Candidate) -> float:
        affinity = 0.0 if overloaded(c, candidates, weights) else c.matched_fraction
        return (
            weights.prefix * affinity
            + weights.queue * (1.0 - c.load / (max_load + 1.0))
            + weights.kv * (1.0 - min(max(c.kv_usage, 0.0), 1.0))
            + weights.spread * (max_cached - c.cached) / cached_spread
        )

    ordered = sorted(
        candidates,
        key=lambda c: (-score(c), overloaded(c, candidates, weights), c.load, c.picks, c.address),
    )
    return [c.address for c in ordered]
