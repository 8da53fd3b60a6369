"""Decode-sized linears: the Triton GEMV (shard/kernels/gemv.py) or cuBLAS, whichever is faster.

    linear(x, weight, bias)        x [M, K] @ weight [N, K].T (+ bias)        -> [M, N]
    gate_up_silu(x, weight, bias)  silu(x @ Wg.T) * (x @ Wu.T), weight [2I, K] -> [M, I]
    linear_pushed(x, weight, push_to)  x @ weight.T into a fused all-reduce's exchange buffers
    tune(weight, dtype, bias, silu_mul=...)   eager: time both backends for every batch bucket

Why: at batch 1..16 a linear is a pass over its weight bytes. cuBLAS (F.linear) streams some
16-bit shapes well below copy bandwidth (the halved TP=2 Llama-3-8B shapes ~81% on an H200) and
adds a split-K reduction kernel after some; the Triton GEMV streams others better. Which wins
depends on the shape and the batch, so it is measured, not guessed.

Tuning: one record per ShapeKey (device, dtype, weight rows, K, bias-ness, SiLU epilogue) holds,
for every M bucket (1, 2, 4, 8, 16), the autotuned Triton config and the winner of a timing of
that config against the cuBLAS path (F.linear, plus elementwise.silu_mul for gate_up_silu). Both
are timed by the same triton.testing.do_bench (median, L2 cleared before every call, events
around each call): a clean L2 is what a decode step's other 31 layers leave a linear, and
do_bench_cudagraph would keep small weights (e.g. 16 MB at TP=2) L2-resident and flatter
whichever backend streams worse. Both paths' extra kernels (cuBLAS's split-K reduce, silu_mul)
run inside the timed window. Triton must win by WIN_MARGIN: ties go to cuBLAS.

Persistence: a record is measured once per machine kind and software build, not once per
process. With a tuning cache configured (shard/kernels/tuning_cache.py: the shard's
`--tuning-cache-dir`, on by default under tokenwire's cache directory), tune() first reads the
record from disk (keyed by GPU model, torch / CUDA / Triton builds, a digest of the kernel sources
and of this dispatcher, weight dtype and shape, activation dtype, bias, epilogue, PDL and the
buckets), and only then measures, under the key's file lock, storing the record for the next
reader: the TP ranks of a deployment, which meet the same shapes at once, measure each shape
once, and a later deployment measures nothing. A record read from disk still has its kernels
compiled (from Triton's on-disk cache when warm) and loaded before it is used.

When tuning happens: explicitly by tune(), or by the first EAGER call of linear/gate_up_silu for
an untuned ShapeKey, whatever its batch (the shard's warm-up runs a large batch eagerly before
capturing small-batch graphs; the whole shape is tuned then). A call made while a CUDA graph is
being captured never tunes (do_bench syncs, a first Triton launch loads a module): for an
untuned shape it falls back to cuBLAS, logs one warning per shape, and the graph keeps cuBLAS.
After tuning, a call never syncs and allocates only its output (x is copied only if it is not
row-contiguous and 16-byte aligned).

The GEMV serves CUDA tensors of bf16/fp16 with a weight of x's dtype, 16-byte aligned, unit
column stride; everything else (CPU, fp32, M > GEMV_MAX_M, Triton missing) runs the torch path.
Triton is imported only when a CUDA call needs it, so this module imports on CPU.
`forced_backend` overrides the choice (tests, benchmarks); nothing is configured at import.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib.util
import logging
import threading
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from shard.kernels import tuning_cache
from shard.kernels.gemv_buckets import GEMV_MAX_M, M_BUCKETS, m_bucket
from shard.kernels.setting import Setting

if TYPE_CHECKING:
    import triton

    from shard.distributed.all_reduce_norm import AllReduceAddRmsNorm

log = logging.getLogger(__name__)

GEMV_DTYPES = (torch.bfloat16, torch.float16)
# Triton must be this much faster than cuBLAS to be chosen: timing noise is ~1%, and on a tie the
# cuBLAS path (no compiled kernels of ours) is the safer one.
WIN_MARGIN = 0.02


# What a row-parallel GEMV pushing its own output saves per fused all-reduce call, measured on
# 2 H200s ([1, 4096] bf16: 12.5 -> 11.7 us per GEMV + reduce step, [16, 4096]: 15.3 -> 14.6;
# benchmarks/harness/tp.py's pushed_linear): the Triton GEMV may be this much slower than cuBLAS and
# still win when it pushes.
PUSH_SAVING_US = 0.75


class Backend(enum.Enum):
    TRITON = "triton"
    CUBLAS = "cublas"


@dataclass(frozen=True)
class ShapeKey:
    """What a tuning result is valid for (the GEMV's specialization and the cuBLAS heuristics'
    inputs). Per device: each GPU loads its own kernels and may be a different model."""

    device: int
    dtype: torch.dtype
    rows: int  # weight rows: N for linear, 2I for gate_up_silu
    k: int
    bias: bool
    silu_mul: bool


@dataclass(frozen=True)
class BucketChoice:
    """One M bucket's tuning result."""

    backend: Backend  # the faster one
    config: triton.Config  # the tuned Triton config (kept when cuBLAS wins: forced runs)
    triton_us: float
    cublas_us: float


# ShapeKey -> {M bucket: choice}. Written under _LOCK (shard workers may be threads, one per
# GPU); read without it (a dict lookup of a key written once).
_TUNED: dict[ShapeKey, dict[int, BucketChoice]] = {}
_LOCK = threading.Lock()
_WARNED: set[ShapeKey] = set()
# Shapes whose GEMV PUSH variants are loaded (linear_pushed), with their tuning record.
_PUSH_READY: dict[ShapeKey, Mapping[int, BucketChoice]] = {}
_FORCED: Setting[Backend | None] = Setting(None)


# ------------------------------------------------------------------------------ public API


def linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """x @ weight.T (+ bias) -> [M, N] in x's dtype: the Triton GEMV where tuning found it
    faster for this shape and M's bucket, else F.linear. See the module docstring for when
    tuning happens."""
    _check_shapes("linear", x, weight, bias)
    choice = _dispatch(x, weight, bias, silu_mul=False)
    if choice is None:
        return F.linear(x, weight, bias)
    return _gemv(x, weight, bias, False, choice.config)


def linear_pushed(
    x: torch.Tensor,  # [M, K], M <= the exchange's rows
    weight: torch.Tensor,  # [N, K], N <= the exchange's hidden
    push_to: AllReduceAddRmsNorm,
) -> bool:
    """A row-parallel linear whose output goes straight into every rank's exchange buffer of the
    fused all-reduce + norm (the GEMV's PUSH epilogue) instead of a tensor; the caller then runs
    `push_to.reduce_pushed`. Returns False, having done nothing, where the GEMV cannot serve the
    call (then: linear() and the fused kernel's own push), or where cuBLAS's plain timing beat
    the tuned Triton config by more than the push saves (PUSH_SAVING_US)."""
    _check_shapes("linear_pushed", x, weight, None)
    if _FORCED.value is Backend.CUBLAS or not _eligible(x, weight, None):
        return False
    key = shape_key(weight, x.dtype, None, False)
    record = _PUSH_READY.get(key)
    if record is None:
        # Prepared at the first eager call of any batch size (the warm-up's large batch too),
        # so that the small-batch graphs captured next can push.
        record = _tuned_record(weight, x.dtype, None, False)
        if record is None or torch.cuda.is_current_stream_capturing():
            return False
        from shard.kernels.gemv import load_push_variants

        with torch.cuda.device(weight.device):
            load_push_variants(weight, x.dtype, [c.config for c in record.values()], push_to)
        _PUSH_READY[key] = record
    m = x.shape[0]
    # One row only: there each program pushes one contiguous run of outputs. With the
    # tensor-core path's [16, BLOCK_N] tiles (M >= 2) the stores are scattered 4-byte pieces
    # over several rows, and the Llama-3-8B TP=2 step measured slower at batch 8 with pushes
    # (3.16 -> 3.28 ms, benchmarks/QUANT_TP.md).
    if m != 1 or not push_to.handles_rows(m, weight.shape[0], x.dtype):
        return False
    choice = record[m_bucket(m)]
    if choice.triton_us > choice.cublas_us + PUSH_SAVING_US:
        return False  # cuBLAS's faster pass outweighs what the push saves
    from shard.kernels.gemv import gemv

    gemv(x, weight, config=choice.config, caller="linear_pushed", push_to=push_to)
    return True


def gate_up_silu(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [2I, K]: rows 0..I-1 gate, I..2I-1 up
    bias: torch.Tensor | None = None,  # [2I]
) -> torch.Tensor:
    """silu(x @ Wg.T) * (x @ Wu.T) -> [M, I] in x's dtype, rounded as the unfused path (gate
    and up to the dtype, then silu(gate), then the product): one fused Triton kernel where
    tuning found it faster, else F.linear + silu_mul."""
    _check_shapes("gate_up_silu", x, weight, bias)
    if weight.shape[0] % 2:
        raise ValueError(
            f"gate_up_silu: weight has {weight.shape[0]} rows; expected 2*I (gate rows, then up)"
        )
    choice = _dispatch(x, weight, bias, silu_mul=True)
    if choice is None:
        return _unfused_gate_up_silu(x, weight, bias)
    return _gemv(x, weight, bias, True, choice.config)


def tune(
    weight: torch.Tensor,  # [N, K] (silu_mul: [2I, K]), CUDA
    dtype: torch.dtype,  # the activations' dtype (the weight's)
    bias: torch.Tensor | None = None,
    *,
    silu_mul: bool = False,
) -> Mapping[int, BucketChoice]:
    """Autotunes the Triton GEMV for every M bucket of this shape and times it against the
    cuBLAS path; records and returns {bucket: choice}. Eager only (host syncs, kernel loads):
    call it before capturing CUDA graphs. Once per ShapeKey; later calls (other layers of the
    same shape) return the record."""
    _check_tunable(weight, dtype, bias)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "decode_linear.tune: called while a CUDA graph is being captured; tune before "
            "capture (it benchmarks with host syncs and loads kernels)"
        )
    key = shape_key(weight, dtype, bias, silu_mul)
    with _LOCK:
        if key not in _TUNED:
            with torch.cuda.device(weight.device):
                _TUNED[key] = _cached_record(weight, dtype, bias, silu_mul)
            log.info("decode_linear: tuned %s: %s", key, _summary(_TUNED[key]))
    return _TUNED[key]


def tuned(
    weight: torch.Tensor,
    dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    *,
    silu_mul: bool = False,
) -> Mapping[int, BucketChoice] | None:
    """The tuning record of this shape, or None if it was never tuned (benchmarks, tests)."""
    return _TUNED.get(shape_key(weight, dtype, bias, silu_mul))


def forced_backend(backend: Backend | None) -> AbstractContextManager[None]:
    """Within the block every eligible call takes `backend` (TRITON: the tuned config, tuning
    eagerly first if needed; CUBLAS: never tunes). Process-wide, not per thread: for tests and
    benchmarks. A graph captured inside the block keeps the backend it captured."""
    return _FORCED.override(backend)


def clear() -> None:
    """Forgets every tuning record (tests). Compiled kernels stay loaded."""
    with _LOCK:
        _TUNED.clear()
        _WARNED.clear()
        _PUSH_READY.clear()


def shape_key(
    weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None, silu_mul: bool
) -> ShapeKey:
    # get_device(): the CUDA index, -1 on CPU
    return ShapeKey(
        weight.get_device(), dtype, weight.shape[0], weight.shape[1], bias is not None, silu_mul
    )


def select_backend(
    m: int, record: Mapping[int, BucketChoice] | None, forced: Backend | None
) -> Backend:
    """The backend of an eligible call with m rows, given its shape's tuning record (None:
    untuned, e.g. met first while capturing) and an override."""
    if m == 0 or m > GEMV_MAX_M or record is None or forced is Backend.CUBLAS:
        return Backend.CUBLAS
    if forced is Backend.TRITON:
        return Backend.TRITON
    return record[m_bucket(m)].backend


def winner(triton_us: float, cublas_us: float) -> Backend:
    """Triton only if faster by WIN_MARGIN (see its comment)."""
    return Backend.TRITON if triton_us < (1.0 - WIN_MARGIN) * cublas_us else Backend.CUBLAS


# ---------------------------------------------------------------------------- internals


def _check_shapes(
    op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [M, K], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"{op}: weight must be [N, K] with K = x's {x.shape[1]}, got {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op}: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def _check_tunable(weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None) -> None:
    if dtype not in GEMV_DTYPES or weight.dtype != dtype:
        raise ValueError(
            f"decode_linear.tune: dtype {dtype}, weight {weight.dtype}; the GEMV takes a "
            f"weight of the activations' dtype, one of {GEMV_DTYPES}"
        )
    if weight.device.type != "cuda":
        raise ValueError(f"decode_linear.tune: weight is on {weight.device}; the GEMV is CUDA-only")
    if weight.dim() != 2 or weight.stride(1) != 1 or not _aligned(weight):
        raise ValueError(
            "decode_linear.tune: weight must be [N, K] with unit column stride, 16-byte aligned"
        )
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous() or not _aligned(bias)):
        raise ValueError("decode_linear.tune: bias must be contiguous, 16-byte aligned, in dtype")


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the GEMV can serve this call at all (else: the torch path, never tuned). All
    eligible tensors share one Triton specialization (aligned, unit stride), the one tuned."""
    return (
        x.is_cuda
        and x.dtype in GEMV_DTYPES
        and weight.dtype == x.dtype
        and weight.stride(1) == 1
        and _aligned(weight)
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous() and _aligned(bias)))
        and _has_triton()
    )


def _dispatch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool
) -> BucketChoice | None:
    """The tuned choice whose Triton config to launch, or None for the torch/cuBLAS path."""
    if _FORCED.value is Backend.CUBLAS or not _eligible(x, weight, bias):
        return None
    record = _tuned_record(weight, x.dtype, bias, silu_mul)
    m = x.shape[0]
    if select_backend(m, record, _FORCED.value) is Backend.CUBLAS:
        return None
    assert record is not None
    return record[m_bucket(m)]


def _tuned_record(
    weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None, silu_mul: bool
) -> Mapping[int, BucketChoice] | None:
    """The shape's tuning record, tuning it now if needed; None if it is untuned and a CUDA
    graph is being captured (tuning syncs and loads kernels)."""
    key = shape_key(weight, dtype, bias, silu_mul)
    record = _TUNED.get(key)
    if record is None:
        if torch.cuda.is_current_stream_capturing():
            _warn_untuned_capture(key)
        else:
            record = tune(weight, dtype, bias, silu_mul=silu_mul)
    return record


def _warn_untuned_capture(key: ShapeKey) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(
            "decode_linear: %s met untuned while capturing a CUDA graph: cuBLAS in this graph "
            "(call tune() or run it eagerly before capture)",
            key,
        )


def _gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu_mul: bool,
    config: triton.Config,
) -> torch.Tensor:
    from shard.kernels.gemv import gemv

    return gemv(x, weight, None, bias, silu_mul=silu_mul, config=config, caller="decode_linear")


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, each rounded to the dtype: elementwise.silu_mul on CUDA, else torch
    (F.silu rounds to the dtype, then the product rounds again: the same two roundings)."""
    if gate.is_cuda and _has_triton():
        from shard.kernels.elementwise import silu_mul

        return silu_mul(gate, up)
    return F.silu(gate) * up


def _unfused_gate_up_silu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    gate, up = F.linear(x, weight, bias).chunk(2, dim=-1)  # [M, I] views of [M, 2I]
    return _silu_mul(gate, up)


@functools.cache
def _dispatcher_version() -> str:
    """A digest of this module's source (WIN_MARGIN, how _measure times): an edited dispatcher
    retunes rather than reading records measured by another."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _cache_key(
    weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None, silu_mul: bool
) -> dict[str, Any]:
    from shard.kernels.gemv import tuning_key

    return {**tuning_key("decode_linear", weight, dtype, bias is not None, silu_mul),
            "dispatcher": _dispatcher_version()}


def _encode(record: Mapping[int, BucketChoice]) -> dict[str, Any]:
    from shard.kernels.gemv import config_dict

    return {"buckets": {str(b): {"backend": c.backend.value, "config": config_dict(c.config),
                                 "triton_us": c.triton_us, "cublas_us": c.cublas_us}
                        for b, c in record.items()}}


def _decode(raw: Mapping[str, Any], weight_dtype: torch.dtype) -> dict[int, BucketChoice]:
    """A record from its tuning-cache value; raises (KeyError / ValueError) on a value that does
    not name a current candidate config and a backend for every bucket."""
    from shard.kernels.gemv import decode_bucket_configs

    buckets = raw["buckets"]
    configs = decode_bucket_configs(
        {"buckets": {b: c["config"] for b, c in buckets.items()}}, weight_dtype)
    return {b: BucketChoice(Backend(buckets[str(b)]["backend"]), configs[b],
                            float(buckets[str(b)]["triton_us"]),
                            float(buckets[str(b)]["cublas_us"]))
            for b in M_BUCKETS}


def _cached_record(
    weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None, silu_mul: bool
) -> dict[int, BucketChoice]:
    """The shape's record: read from the process's tuning cache (its kernels then loaded) or
    measured (and stored there); with no cache configured, measured."""

    def read(raw: Mapping[str, Any]) -> dict[int, BucketChoice]:
        record = _decode(raw, weight.dtype)
        _load_kernels(weight, dtype, bias, silu_mul, record)
        return record

    return tuning_cache.cached_tuning(
        _cache_key(weight, dtype, bias, silu_mul),
        lambda: _measure(weight, dtype, bias, silu_mul),
        _encode,
        read,
    )


def _load_kernels(
    weight: torch.Tensor,
    dtype: torch.dtype,
    bias: torch.Tensor | None,
    silu_mul: bool,
    record: Mapping[int, BucketChoice],
) -> None:
    """What _measure leaves behind besides the record, for a record read from disk: every
    bucket's Triton config compiled and loaded (a CUDA-graph capture may not load one; forced
    TRITON runs use the config even where cuBLAS won) and the cuBLAS path run once per bucket."""
    from shard.kernels.gemv import load_configs

    load_configs(weight, None, bias, dtype, silu_mul, {b: c.config for b, c in record.items()})
    x = torch.zeros((GEMV_MAX_M, weight.shape[1]), dtype=dtype, device=weight.device)  # [16, K]
    cublas = _unfused_gate_up_silu if silu_mul else F.linear
    for bucket in record:
        cublas(x[:bucket], weight, bias)


def _measure(
    weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None, silu_mul: bool
) -> dict[int, BucketChoice]:
    """Autotunes the GEMV per bucket, then times its config and the cuBLAS path alike: batch 1
    back to back in a CUDA graph, as its config was chosen (shard/kernels/graph_timing.py; a
    single-call timing of the in-graph pick can lose to cuBLAS's there and flip the choice to
    the slower path in the step), larger buckets one call at a time like the autotuner."""
    from shard.kernels.gemv import bench_us, tune_gemv
    from shard.kernels.graph_timing import time_in_graph_us, weight_views

    configs = tune_gemv(weight, None, bias, dtype, silu_mul=silu_mul, cached=False)
    x = torch.randn((GEMV_MAX_M, weight.shape[1]), dtype=dtype, device=weight.device)  # [16, K]
    cublas = _unfused_gate_up_silu if silu_mul else F.linear
    views = weight_views(weight)
    record = {}
    for bucket in M_BUCKETS:
        xb, cfg = x[:bucket], configs[bucket]
        if bucket == 1:
            t_triton = time_in_graph_us(
                lambda w, xb=xb, cfg=cfg: _gemv(xb, w, bias, silu_mul, cfg), views)
            t_cublas = time_in_graph_us(lambda w, xb=xb: cublas(xb, w, bias), views)
        else:
            t_triton = bench_us(functools.partial(_gemv, xb, weight, bias, silu_mul, cfg))
            t_cublas = bench_us(functools.partial(cublas, xb, weight, bias))
        record[bucket] = BucketChoice(winner(t_triton, t_cublas), cfg, t_triton, t_cublas)
    return record


def _summary(record: Mapping[int, BucketChoice]) -> str:
    return ", ".join(
        f"M{b} {c.backend.value} ({c.triton_us:.1f} vs {c.cublas_us:.1f} us)"
        for b, c in record.items()
    )
