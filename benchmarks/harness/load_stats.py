"""Figures of one served load run, the same for every server the harness drives (tokenwire over
gRPC, vLLM over SSE), so their rows are computed alike.

A client result is a dict: idx, in (prompt words), out (requested new tokens), t0 (send time,
epoch s), times (epoch s of each streamed event that carried tokens), count (tokens received),
reason (finish reason), error ("" when none).
"""

from __future__ import annotations

import statistics


def pct(xs: list[float], p: float) -> float:
    """The p-th percentile of sorted xs (nearest rank, as the harness always reported)."""
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


def summarize_streams(results: list[dict], start_at: float, startup_s: float) -> dict:
    """req/s, output tok/s, TTFT and ITL percentiles, exact lengths of a run whose requests were
    all released at `start_at` (epoch s). ITL: gaps between consecutive events of a stream."""
    ok = [r for r in results if not r["error"] and r["times"]]
    end = max((r["times"][-1] for r in ok), default=start_at)
    wall = end - start_at
    ttft = sorted(r["times"][0] - r["t0"] for r in ok)
    itl = sorted(b - a for r in ok for a, b in zip(r["times"], r["times"][1:]))
    out_tokens = sum(r["count"] for r in ok)
    reasons: dict[str, int] = {}
    for r in results:
        reasons[r["reason"] or "none"] = reasons.get(r["reason"] or "none", 0) + 1
    return {
        "requests": len(results), "ok": len(ok),
        "errors": [r["error"] for r in results if r["error"]][:5],
        "finish_reasons": reasons, "startup_seconds": startup_s, "wall_seconds": wall,
        "requests_per_s": len(ok) / wall if wall > 0 else float("nan"),
        "output_tokens_per_s": out_tokens / wall if wall > 0 else float("nan"),
        "mean_input": statistics.mean(r["in"] for r in results) if results else float("nan"),
        "mean_output": statistics.mean(r["count"] for r in results) if results else float("nan"),
        "exact_lengths": sum(r["count"] == r["out"] for r in results),
        "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
        "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p99_ms": pct(itl, 99) * 1e3,
    }
