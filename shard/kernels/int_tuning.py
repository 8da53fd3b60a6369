"""Picks the W4A16 / W8A16 kernels' launch configs by measured time, per weight shape and batch
bucket, at warm-up (eagerly: compiles and host syncs), never while a CUDA graph is captured.

- GEMV (shard/kernels/int_gemv.py), batch buckets 1, 2, 4, 8, 16 (gemv_buckets.M_BUCKETS): batch 1
  is timed back to back in a CUDA graph over weight copies that overflow the L2, as a decode step
  runs it (shard/kernels/graph_timing.py: ramp-up and tails show there); the other buckets with
  Triton's do_bench, L2 cleared before each call (shard/kernels/gemv.py's bench_us).
- GEMM (shard/kernels/int_gemm.py), buckets GEMM_M_BUCKETS (32 .. 4096, the next power of two of
  M): up to GRAPH_TIMED_GEMM_MAX rows (the decode steps CUDA graphs replay) in a CUDA graph as
  batch 1 (on an H100, do_bench's eager times once picked o_proj's cuBLAS path at 64 rows, 24.4
  us in the graph against 17.4 for the graph-fastest: benchmarks/INT_KERNELS.md, round 14),
  above that do_bench; the candidates include dequantize-then-cuBLAS (int_gemm's "cublas"
  path), so no bucket runs slower than that.
Every chosen config is then launched once at its bucket's batch, which loads its kernel on the
device; a later launch at any M of the bucket hits the same compiled kernel (M is not
specialized on), so CUDA-graph capture launches nothing new.

Choices are shared: in this process per (shape, bits, group, bias, dtypes, zero kind, device), so
a model's 32 layers of one shape are tuned once; across ranks and runs through the tuning cache
(shard/kernels/tuning_cache.py) when one is configured. Off CUDA (the interpreter tests) nothing is
timed: each bucket takes its first candidate.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
import triton.runtime.errors

from shard.kernels import int_gemm, int_gemv, tuning_cache
from shard.kernels.gemv_buckets import M_BUCKETS
from shard.kernels.int_gemm import GEMM_M_BUCKETS, GemmConfig
from shard.kernels.int_gemv import GemvConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IntWeightView:
    """What a launch needs besides x: one linear's packed weight (PackedInt's tensors)."""

    qweight: torch.Tensor  # [N, K/2] (int4) or [N, K] (int8) uint8
    scales: torch.Tensor  # [N, G]
    zeros: torch.Tensor  # [N, G]
    group_size: int
    bits: int
    int_zeros: bool
    bias: torch.Tensor | None
    counters: torch.Tensor | None  # split-K counters (int32, zero)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (8 // self.bits)

    def gemv(self, x: torch.Tensor, config: GemvConfig,
             qweight: torch.Tensor | None = None) -> torch.Tensor:
        return int_gemv.int4_gemv(x, self.qweight if qweight is None else qweight, self.scales,
                                  self.zeros, self.group_size, self.bias, bits=self.bits,
                                  int_zeros=self.int_zeros, config=config,
                                  counters=self.counters)

    def gemm(self, x: torch.Tensor, config: GemmConfig,
             qweight: torch.Tensor | None = None) -> torch.Tensor:
        return int_gemm.int_gemm(x, self.qweight if qweight is None else qweight, self.scales,
                                 self.zeros, self.group_size,
                                 self.bias, bits=self.bits, config=config,
                                 counters=self.counters, int_zeros=self.int_zeros)


@dataclass(frozen=True)
class IntTuning:
    """The chosen config of every bucket of one weight shape and activation dtype."""

    gemv: dict[int, GemvConfig]  # GEMV bucket -> config
    gemm: dict[int, GemmConfig]  # GEMM bucket -> config

    def encode(self) -> dict[str, Any]:
        return {"gemv": {str(b): c.as_dict() for b, c in self.gemv.items()},
                "gemm": {str(b): c.as_dict() for b, c in self.gemm.items()}}

    @classmethod
    def decode(cls, raw: Mapping[str, Any], group_size: int, in_features: int) -> IntTuning:
        """Raises unless every bucket names a current candidate (a stale entry is retuned)."""
        gemv = {b: GemvConfig(**raw["gemv"][str(b)]) for b in M_BUCKETS}
        gemm = {b: GemmConfig(**raw["gemm"][str(b)]) for b in GEMM_M_BUCKETS}
        for b, c in gemv.items():
            if c not in int_gemv.candidates(b, group_size, in_features):
                raise ValueError(f"GEMV config {c} is not a candidate for batch {b}")
        for b, c in gemm.items():
            if c not in int_gemm.candidates(b, group_size, in_features):
                raise ValueError(f"GEMM config {c} is not a candidate for batch {b}")
        return cls(gemv, gemm)


_SOURCES = ("int_gemv.py", "int_gemv_wide.py", "int_tiles.py", "int_gemm.py", "int_gemm_lop3.py",
            "int_dequant.py", "int_tuning.py", "graph_timing.py")


@functools.cache
def kernel_version() -> str:
    """Digest of the kernels' and candidates' source: part of every tuning-cache key."""
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in _SOURCES:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


# A tuning candidate whose output is further than this from the dequantized weight's product
# (relative to the largest |y|) is not chosen: x's dtype rounds y to 2^-8 (bf16); the tests bound
# the kernels at 2^-7.
_CHECK_BOUND = 2**-6

# GEMM buckets up to this many rows are decode steps the CUDA graphs replay (shard/runner/
# cuda_graphs.py captures up to the server's max batch, 256 by default): timed in a graph, as
# they run; larger ones are prefill chunks, launched eagerly and timed so.
GRAPH_TIMED_GEMM_MAX = 256

_MEMO: dict[tuple, IntTuning] = {}
# Every timed candidate of the tunings this process ran: (N, K, "gemv" | "gemm", bucket) ->
# {config: microseconds} (inf: failed to compile or run). For benchmarks/int4_kernels.py's report.
TIMINGS: dict[tuple[int, int, str, int], dict[str, float]] = {}


def tune_int_linear(w: IntWeightView, dtype: torch.dtype) -> IntTuning:
    """Every bucket's config for this weight shape and activation dtype, tuned (or read from the
    caches) and loaded on the weight's device. Eager only."""
    device = w.qweight.device
    memo = (tuple(w.qweight.shape), w.scales.shape[1], w.bits, w.group_size, w.bias is not None,
            w.scales.dtype, w.zeros.dtype, w.int_zeros, dtype, device.type, device.index)
    if device.type != "cuda":
        tuned = _MEMO.get(memo)
        if tuned is None:
            tuned = _MEMO[memo] = _defaults(w)
        return tuned
    tuned = _MEMO.get(memo)
    if tuned is None:
        key = {"op": "int_linear", "kernel": kernel_version(), **tuning_cache.device_key(device),
               "rows": w.qweight.shape[0], "k": w.in_features, "groups": w.scales.shape[1],
               "bits": w.bits, "group_size": w.group_size, "bias": w.bias is not None,
               "scale_dtype": str(w.scales.dtype), "zero_dtype": str(w.zeros.dtype),
               "int_zeros": w.int_zeros, "dtype": str(dtype)}
        tuned = tuning_cache.cached_tuning(
            key, lambda: _tune(w, dtype), IntTuning.encode,
            functools.partial(IntTuning.decode, group_size=w.group_size,
                              in_features=w.in_features))
        _MEMO[memo] = tuned
    _load(w, dtype, tuned)
    return tuned


def _defaults(w: IntWeightView) -> IntTuning:
    k = w.in_features
    return IntTuning(
        {b: int_gemv.candidates(b, w.group_size, k)[0] for b in M_BUCKETS},
        {b: int_gemm.candidates(b, w.group_size, k)[0] for b in GEMM_M_BUCKETS},
    )


def _fastest(time_us: Callable[[Any], float], pool: list,
             check: Callable[[Any], str | None] | None = None) -> tuple[Any, dict[str, float]]:
    """The fastest config of `pool` by time_us; `check` (None: fine, else what is wrong) runs
    first and excludes a config whose output is wrong."""
    timings: dict[str, float] = {}
    best: tuple[float, Any] | None = None
    for config in pool:
        try:
            wrong = None if check is None else check(config)
            if wrong is not None:
                log.warning("int kernel candidate %s gave a wrong result (%s); skipped", config,
                            wrong)
                timings[str(config)] = math.inf
                continue
            us = time_us(config)
        except triton.runtime.errors.OutOfResources:  # e.g. shared memory: not a candidate here
            us = math.inf
        except Exception as exc:  # noqa: BLE001 - a candidate that fails here is not chosen
            log.warning("int kernel candidate %s failed (%s: %s); skipped", config,
                        type(exc).__name__, str(exc)[:300])
            us = math.inf
        timings[str(config)] = us
        if best is None or us < best[0]:
            best = (us, config)
    if best is None or best[0] == math.inf:
        raise RuntimeError(f"no int kernel candidate ran: {timings}")
    return best[1], timings


def _wrong(y: torch.Tensor, ref: torch.Tensor) -> str | None:
    """None where y [M, N] is within _CHECK_BOUND of fp32 ref (relative to its largest |y|), else
    what is wrong (_fastest's check)."""
    err = float((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
    return None if err <= _CHECK_BOUND else f"max error {err:.2e} of max |y|"


def _dequantized(w: IntWeightView) -> torch.Tensor:
    """[N, K] fp32: (q - zero) * scale, as PackedInt.dequantize computes it (the kernels'
    reference; shard.kernels imports no quantization code)."""
    q = w.qweight
    n, k = q.shape[0], w.in_features
    if w.bits == 4:
        q = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(n, k)
    g = torch.arange(k, device=q.device) // min(w.group_size, k)
    return (q.float() - w.zeros.float()[:, g]) * w.scales.float()[:, g]


def _tune(w: IntWeightView, dtype: torch.dtype) -> IntTuning:
    from shard.kernels.gemv import bench_us
    from shard.kernels.graph_timing import time_in_graph_us, weight_views

    k = w.in_features
    device = w.qweight.device
    gemv: dict[int, GemvConfig] = {}
    views = weight_views(w.qweight)

    def timer(run: Callable[..., torch.Tensor], x: torch.Tensor,
              in_graph: bool) -> Callable[[Any], float]:
        """Microseconds of run(x, config): in a CUDA graph cycling through the weight's views (as
        decode steps replay it), else launched eagerly (prefill chunks)."""
        if in_graph:
            return lambda c: time_in_graph_us(lambda q: run(x, c, q), views)
        return lambda c: bench_us(lambda: run(x, c))

    # Each GEMV candidate's output is checked once against the dequantized weight before it is
    # timed: the lop3 tiles' unpack is inline PTX, which no CPU test executes.
    w_ref = _dequantized(w)  # [N, K] fp32
    for bucket in M_BUCKETS:
        x = torch.randn((bucket, k), dtype=dtype, device=device)
        ref = x.float() @ w_ref.t() + (0.0 if w.bias is None else w.bias.float())

        def check(c: GemvConfig, x: torch.Tensor = x, ref: torch.Tensor = ref) -> str | None:
            return _wrong(w.gemv(x, c), ref)

        pool = int_gemv.candidates(bucket, w.group_size, k)
        gemv[bucket], times = _fastest(timer(w.gemv, x, bucket == 1), pool, check)
        TIMINGS[(w.qweight.shape[0], k, "gemv", bucket)] = times
    del w_ref
    gemm: dict[int, GemmConfig] = {}
    for bucket in GEMM_M_BUCKETS:
        x = torch.randn((bucket, k), dtype=dtype, device=device)
        pool = int_gemm.candidates(bucket, w.group_size, k)
        ref = None
        # the lop3 / lop3z (inline PTX) and split-K (counters, partials) candidates are
        # checked as the GEMVs are
        if any(_checked(c) for c in pool):
            w_ref = _dequantized(w)
            ref = x.float() @ w_ref.t() + (0.0 if w.bias is None else w.bias.float())
            del w_ref

        def check(c: GemmConfig, x: torch.Tensor = x, ref: torch.Tensor | None = ref
                  ) -> str | None:
            if not _checked(c) or ref is None:
                return None
            return _wrong(w.gemm(x, c), ref)

        gemm[bucket], times = _fastest(timer(w.gemm, x, bucket <= GRAPH_TIMED_GEMM_MAX), pool,
                                       check)
        TIMINGS[(w.qweight.shape[0], k, "gemm", bucket)] = times
    return IntTuning(gemv, gemm)


def _checked(c: GemmConfig) -> bool:
    """Whether a GEMM candidate's output is checked before it is timed: the inline-PTX tiles and
    the split-K ones (the others' code paths run in the interpreter tests as compiled)."""
    return c.path in ("lop3", "lop3z") or c.split_k > 1


def _load(w: IntWeightView, dtype: torch.dtype, tuned: IntTuning) -> None:
    """One launch per bucket (loads its kernel on this device), then a sync so that a failing
    launch raises here rather than in a graph capture."""
    k = w.in_features
    x = torch.zeros((GEMM_M_BUCKETS[0], k), dtype=dtype, device=w.qweight.device)
    for bucket, config in tuned.gemv.items():
        w.gemv(x[:bucket], config)
    for config in set(tuned.gemm.values()):
        w.gemm(x, config)
    torch.cuda.synchronize(w.qweight.device)
