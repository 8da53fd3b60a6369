"""How the picker ranks replicas for one request: prefix affinity balanced against load.

Each ready replica gets a score (higher is better), in the spirit of GIE's scorers:

    score = prefix_weight * matched_fraction      (prompt chunks probably cached there, 0..1)
          + queue_weight  * (1 - load / (max_load + 1))   (load: waiting + running requests)
          + kv_weight     * (1 - kv_cache_usage)
          + spread_weight * (1 - share / (max_share + 1))  (share: its recent picks, ~10 s)

and two guards that take the affinity credit away, so that hot prefixes cannot pile requests on
one replica: its load exceeds the least-loaded replica's by more than `balance_slack` requests
(SGLang's cache-aware router has the same escape), or its recent share of the picks exceeds
`max_share` times the mean. A prefix that then lands elsewhere is cached there too, and both
replicas match it from then on. The spread term sends new prefixes to the replicas that got the
fewest requests lately. Ties go to the lower load, then to the replica picked least often. The result is every ready replica, best first: the first is the
destination, the rest are the fallbacks Envoy retries in order.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Weights:
    """Weights of the score's terms and the imbalance guard."""

    prefix: float = 3.0
    queue: float = 1.0
    kv: float = 1.0
    balance_slack: float = 32.0  # requests (SGLang's cache-aware router uses 32 too)
    spread: float = 1.0
    max_share: float = 1.25  # times the mean recent share
    min_share_picks: float = 8.0  # below this mean, shares say nothing yet


@dataclass(frozen=True)
class Candidate:
    """One ready replica as the scorer sees it."""

    address: str  # ip:port, as Envoy names the endpoint
    load: float  # waiting + running requests, plus picks not yet visible in its metrics
    kv_usage: float  # fraction of KV blocks held by requests, 0..1
    matched_fraction: float  # share of the request's prompt chunks it probably caches, 0..1
    picks: int = 0  # requests sent there so far (last tie-break)
    share: float = 0.0  # recent picks (decayed over ~10 s)


def rank(candidates: list[Candidate], weights: Weights) -> list[str]:
    """Addresses of `candidates`, best first."""
    if not candidates:
        return []
    min_load = min(c.load for c in candidates)
    max_load = max(c.load for c in candidates)
    mean_share = sum(c.share for c in candidates) / len(candidates)
    top_share = max(c.share for c in candidates)

    def score(c: Candidate) -> float:
        overloaded = c.load - min_load > weights.balance_slack or (
            mean_share >= weights.min_share_picks and c.share > weights.max_share * mean_share
        )
        affinity = 0.0 if overloaded else c.matched_fraction
        return (
            weights.prefix * affinity
            + weights.queue * (1.0 - c.load / (max_load + 1.0))
            + weights.kv * (1.0 - min(max(c.kv_usage, 0.0), 1.0))
            + weights.spread * (1.0 - c.share / (top_share + 1.0))
        )

    ordered = sorted(candidates, key=lambda c: (-score(c), c.load, c.picks, c.address))
    return [c.address for c in ordered]
