"""Kernel-level time breakdown of a GPU callable (benchmarks only; needs CUDA).

torch.profiler with CUPTI records every kernel, also those replayed from a CUDA graph, so the same
function explains eager steps and graph replays: device milliseconds per kernel class per call and
kernels per call. The gap between a graph replay's time and its kernel sum is launch/idle time
inside the graph; for tensor parallelism, time in all-reduce kernels includes waiting for the
slower rank.
"""

from __future__ import annotations

import collections
from collections.abc import Callable


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
