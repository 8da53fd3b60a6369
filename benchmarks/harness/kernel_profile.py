"""Kernel-level time breakdown of a GPU callable (benchmarks only; needs CUDA).

torch.profiler with CUPTI records every kernel, also those replayed from a CUDA graph, so the same
function explains eager steps and graph replays: device milliseconds per kernel class per call and
kernels per call. The gap between a graph replay's time and its kernel sum is launch/idle time
inside the graph; for tensor parallelism, time in all-reduce kernels includes waiting for the
slower rank.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable


def classify(name: str) -> str:
    """Kernel name -> a short class (matmul, attention, all_reduce, ...) or 'other:<name>'."""
    n = name.lower()
    if "all_reduce" in n or "allreduce" in n or "nccl" in n or "all_gather" in n:
        return "collective"
    if "gemv" in n or "gemm" in n or "cutlass" in n or "sm90" in n or "xmma" in n or "nvjet" in n:
        return "matmul"
    if "_decode_split" in n or "_decode_merge" in n:
        return "attention"
    if "_store_kv" in n:
        return "kv_store"
    if "rotary" in n or "rope" in n:
        return "rotary"
    if "rms_norm" in n:
        return "norm"
    if "silu" in n:
        return "silu_mul"
    return "other:" + name[:60]


def profile_kernels(fn: Callable[[], object], calls: int = 5) -> dict:
    """Runs fn `calls` times under the profiler; returns {"kernel_sum_ms", "kernels_per_call",
    "classes": {class: [ms per call, kernels per call]}} sorted by time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    by_class: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t <= 0 or evt.count <= 0:
            continue
        c = classify(evt.key)
        by_class[c] += t / calls / 1e3  # us total -> ms per call
        counts[c] += evt.count // calls
    ranked = sorted(by_class.items(), key=lambda kv: -kv[1])
    return {"kernel_sum_ms": sum(by_class.values()), "kernels_per_call": sum(counts.values()),
            "classes": {k: [round(v, 4), counts[k]] for k, v in ranked}}


def exposed_by_kernel(spans: Iterable[tuple[str, float, float]]) -> tuple[dict[str, float], float]:
    """Each kernel's exposed time on one stream's timeline, from (name, start, end) spans in any
    order: sorted by start, a kernel is charged the stretch by which it moves the timeline's end
    forward, end - max(the latest end before it, its start). Idle stretches (a start after every
    earlier end) are summed apart. Charges plus idle cover the timeline from the first start to
    the last end once.

    Why: with programmatic dependent launch (shard/kernels/pdl.py) a kernel starts while its
    predecessor still runs, so kernel durations overlap and their sum overstates the step; the
    charge is the part of a kernel that lies on the step's critical path, after everything
    before it finished (its post-wait work: latency hops, its tail)."""
    frontier = -math.inf
    charged: dict[str, float] = collections.defaultdict(float)
    idle = 0.0
    for name, start, end in sorted(spans, key=lambda span: span[1]):
        if frontier > -math.inf and start > frontier:
            idle += start - frontier
        base = max(frontier, start)
        if end > base:
            charged[name] += end - base
        frontier = max(frontier, end)
    return dict(charged), idle


def device_spans(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every device activity (kernels, copies) a torch.profiler run
    recorded (CUPTI; graph replays included), in its event order."""
    spans = []
    for evt in prof.events():
        if "CUDA" not in str(getattr(evt, "device_type", "")):
            continue
        interval = getattr(evt, "time_range", None)
        if interval is not None and interval.end > interval.start:
            spans.append((evt.name, float(interval.start), float(interval.end)))
    return spans


def label_by_neighbours(spans: Iterable[tuple[str, float, float]],
                        short: Callable[[str], str]) -> list[tuple[str, float, float]]:
    """The spans sorted by start, each named 'previous > this > next' in `short` names: a
    kernel that runs several times a layer (the GEMVs, the add + norms) is told apart by where
    it runs (q/k/v after the input norm, o_proj after the attention, the router before the
    routing)."""
    ordered = sorted(spans, key=lambda span: span[1])
    names = ["^"] + [short(name) for name, _, _ in ordered] + ["$"]  # [0], [-1]: the ends
    return [(" > ".join(names[i:i + 3]), start, end) for i, (_, start, end) in enumerate(ordered)]
