"""Times kernels the way a decode step runs them: back to back in a CUDA graph (used to rank
batch-1 decode GEMV configs, gemv.fastest_in_graph, and the GEMV-vs-cuBLAS choice,
shard/layers/decode_linear.py).

Why: Triton's autotuner (shard/kernels/gemv.py) times one launch at a time with the L2 cleared
before each. A decode step instead runs its GEMVs back to back inside a CUDA graph, where a
config's ramp-up and tail overlap its neighbours' (more so with programmatic dependent launch,
shard/kernels/pdl.py, where the first weight tile streams during the previous kernel). The two timings
rank some configs differently: for the Llama-3-8B fp8 q/k/v and gate/up shapes the autotuner's
pick was 0.4-0.9 us per call slower in-graph than the best candidate
(benchmarks/raw/gemv_sweep_fp8_h200.json). Batch 1 is where that matters (the GEMVs are shortest),
so its candidates are re-ranked in-graph after autotuning.

How: a graph of >= 16 launches cycling through weight-shaped views of a scratch buffer larger than
twice the L2 (so every launch streams from DRAM, as with a model's distinct layers; the scratch
holds whatever bytes it holds: only the timing is used), replayed a few times; the median per-
launch time decides. At most 1,024 views: toy-sized weights (< ~100 KB) are timed partly from L2
(see _MAX_VIEWS). Shapes whose weight alone overflows the L2 twice use the weight itself.
Eager only, like all tuning (compiles, host syncs).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import torch

_MIN_LAUNCHES = 16
_REPLAYS = 5
# At most this many views (launches per graph). Without a cap a toy model's weight (a [64, 64]
# bf16 tile: 8 KB) needed ~12,800 views to overflow an H100's 50 MB L2 twice, and each timing
# launched, captured and replayed that many kernels: ~1 s per timing, ~13 timings per shape,
# most of a 0.3 MiB model's 86 s warm-up (benchmarks/MULTI_GPU.md). With the cap, weights below
# 2 x L2 / 1024 (~100 KB on an H100, ~120 KB on an H200) are timed partly from L2: only toy
# models have linears that small, and a real step of such a model finds its weights in L2 too.
_MAX_VIEWS = 1024


def weight_views(weight: torch.Tensor) -> list[torch.Tensor]:
    """Weight-shaped tensors whose bytes together overflow the L2 twice: [weight] when it does
    alone, else views of one scratch allocation (freed with the list); at most _MAX_VIEWS."""
    l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
    size = weight.numel() * weight.element_size()
    if size >= 2 * l2:
        return [weight]
    count = min(math.ceil(2 * l2 / size), _MAX_VIEWS)
    flat = torch.empty(count * weight.numel(), dtype=weight.dtype, device=weight.device)
    return [part.view(weight.shape) for part in flat.chunk(count)]


def time_in_graph_us(call: Callable[[torch.Tensor], object], views: Sequence[torch.Tensor]) -> float:
    """Median microseconds per call of call(view) when >= 16 calls cycling through `views` run
    back to back in a CUDA graph (compiled and warmed up eagerly first)."""
    device = views[0].device
    rounds = math.ceil(_MIN_LAUNCHES / len(views))

    def calls() -> None:
        for _ in range(rounds):
            for w in views:
                call(w)

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        calls()  # compiles and loads what the calls launch before the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    times = []
    for _ in range(_REPLAYS):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 1e3 * statistics.median(times) / (rounds * len(views))
