"""Weight-streaming matmul for decode-sized batches (CUDA, Triton): bf16/fp16 or fp8 weights.

y[M, N] = x[M, K] @ W[N, K].T (* scale[N]) (+ bias[N]), x bf16/fp16, y in x's dtype, W either
- 16-bit (bf16/fp16, an unquantized model's weight; no scale), or
- float8_e4m3fn with one fp32 scale per output channel (fp8.Fp8Linear's layout; weight-only
  quantization, front: shard/kernels/fp8_gemv.py).
Optionally with a fused SiLU-and-mul epilogue for a merged gate/up weight W[2I, K] (rows 0..I-1
gate, I..2I-1 up): y[M, I] = silu(x @ Wg.T) * (x @ Wu.T), one kernel instead of a GEMM and
elementwise.silu_mul.

Why: at decode batch sizes a linear layer is a pass over its weight bytes and nothing else. For
fp8 the alternative W8A8 path spends more on its activation-quantization kernel and GEMM tiling
than it saves; for 16-bit weights cuBLAS's GEMV-like kernels stream the halved tensor-parallel
shapes well below copy bandwidth (~81% on an H200) and add a split-K reduction kernel to some.
shard/layers/decode_linear.py times both per shape and batch bucket and keeps the faster.

Design (memory-bound: what matters is bytes in flight, ~26-40 KB per SM on an H200):
- Each program owns BLOCK_N weight rows and loops over the whole K. No split-K: the 8B shapes
  give 128..7168 programs with BLOCK_N 4..64, several per SM, and split-K would need an atomic-add
  output zeroed by one more kernel per linear. Small N (unfused k/v projections, N = 1024) gets
  only ~2 programs per SM and streams well below bandwidth: fuse such projections instead.
- M == 1 (`USE_DOT=False`): CUDA cores. Each iteration converts its [BLOCK_N, BLOCK_K] tile
  to fp32, multiplies by the x row and reduces over K into a [BLOCK_N] accumulator right away, so
  registers hold only the raw weight bytes in flight, not an fp32 copy of the tile.
- 2 <= M <= 16 (`USE_DOT=True`): tensor cores. The x rows are padded to the MMA's 16-row tile
  (masked loads, nothing read from memory for padding rows) and
  tl.dot(x [16, BLOCK_K], w.to(x dtype) [BLOCK_K, BLOCK_N]) accumulates in fp32. On CUDA cores
  each weight element would cost M FMAs plus its conversion; at ~4.3 TB/s an SM can spend only
  ~7.8 thread instructions per weight byte (fp8: exceeded from M ~ 4 on; 16-bit weights have
  half the elements per byte, so from M ~ 8), while the MMA absorbs all 16 rows at the same
  conversion cost. The 16-row tile is also why GEMV_MAX_M is 16: a larger batch needs a second
  row tile (the weight read twice, or a GEMM's tiling), which cuBLAS / _scaled_mm do well.
- Loads are software-pipelined through shared memory with cp.async (`tl.range(...,
  num_stages=STAGES)`, which also pipelines loads that feed no dot) or, with STAGES=1, issued as
  16-byte vector loads straight into registers (PREFETCH: one tile ahead, a register double
  buffer); weight loads are marked evict-first (read once).
- SILU_MUL: a program's BLOCK_N weight rows are BLOCK_N/2 gate rows interleaved with the matching
  up rows (tile row 2j: gate row c_j, 2j+1: up row I + c_j), so the bytes in flight per config
  are the same as without the epilogue and the epilogue splits the tile's last axis in pairs.

Programmatic dependent launch (shard/kernels/pdl.py), batch 1: a program loads its first weight tile
before waiting on the previous kernel, so the start of the weight stream overlaps that kernel's
tail; batch 1's config is chosen by timing the candidates back to back in a CUDA graph
(shard/kernels/graph_timing.py), where that overlap and each config's ramp and tail show.

CUDA graphs: everything a launch needs must be compiled and loaded before capture (Triton's
first launch loads a module, which a capturing stream forbids) and autotuning benchmarks with
host syncs, so `tune_gemv` runs every M bucket eagerly once per (weight shape, bias, epilogue,
dtypes). After that a launch allocates only the output and never syncs. `gemv` normalizes x (unit
column stride, rows K apart, 16-byte aligned) so that capture-time calls hit the same compiled
specialization as the tuning calls.

Imported only on CUDA (Triton is not a CPU dependency); the kernel itself also runs under
TRITON_INTERPRET=1 on CPU tensors (tests/shard/test_quantization.py,
tests/shard/test_triton_gemv_interpreter.py).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
import triton.runtime.errors
from triton.runtime.autotuner import Autotuner

from shard.kernels import pdl, tuning_cache
from shard.kernels.all_reduce_norm import ExchangeTarget, push_to_exchange
from shard.kernels.gemv_buckets import GEMV_MAX_M, M_BUCKETS, m_bucket
from shard.kernels.graph_timing import time_in_graph_us, weight_views
from shard.kernels.pdl import let_dependents_launch, wait_for_predecessor

FP8_DTYPE = torch.float8_e4m3fn
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, FP8_DTYPE)


@triton.jit
def _epilogue(
    acc,  # [ROWS, BLOCK_N] fp32: x @ W[rows].T, unscaled
    offs_m,  # [ROWS] row indices of x / y
    rows,  # [BLOCK_N] weight rows of the tile
    row_mask,  # [BLOCK_N]
    pid,
    s_ptr,
    b_ptr,
    y_ptr,
    xchg_ptr,
    xstate_ptr,
    M,
    N,
    stride_ym,
    ROWS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PUSH: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    MAX_ROWS: tl.constexpr,
    MAX_HIDDEN: tl.constexpr,
):
    out_ty = y_ptr.dtype.element_ty
    y = acc
    if HAS_SCALE:
        y = y * tl.load(s_ptr + rows, mask=row_mask, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        # Roundings as the unfused path (a matmul's output, then elementwise.silu_mul): gate and
        # up rounded to the model dtype, silu(gate) rounded, the product rounded.
        y = y.to(out_ty).to(tl.float32)
        g, u = tl.split(tl.reshape(y, [ROWS, BLOCK_N // 2, 2]))  # [ROWS, BLOCK_N // 2] each
        a = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
        y = a * u
        offs_out = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        offs_out = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_out[None, :] < N)
    if PUSH:
        # A row-parallel output: straight into every rank's all-reduce exchange buffer
        # (shard.distributed.all_reduce_norm), not into y; the fused reduce that follows only waits.
        bits = y.to(out_ty).to(tl.int16, bitcast=True)
        push_to_exchange(bits, offs_m, offs_out, mask, tl.load(xstate_ptr), xchg_ptr, RANK, WORLD,
                         MAX_ROWS, MAX_HIDDEN)
    else:
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_out[None, :], y.to(out_ty),
                 mask=mask)


@triton.jit
def _weight_tile(w_rows, k, row_mask, K):
    """[BLOCK_N, BLOCK_K] weight tile at columns k of the program's rows (w_rows: [BLOCK_N]
    row-start pointers); read once, so marked evict-first to keep the caches for x."""
    return tl.load(
        w_rows[:, None] + k[None, :],
        mask=row_mask[:, None] & (k < K)[None, :],
        other=0.0,
        eviction_policy="evict_first",
    )


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _gemv_kernel(
    x_ptr,  # [M, K] bf16/fp16, rows stride_xm apart, unit column stride
    w_ptr,  # [N, K] (SILU_MUL: [2N, K]) bf16/fp16/float8_e4m3fn, unit column stride
    s_ptr,  # [rows of w] float32 per output channel; read only when HAS_SCALE
    b_ptr,  # [rows of w] any float dtype; read only when HAS_BIAS
    y_ptr,  # [M, N] x's dtype, rows stride_ym apart (not written when PUSH)
    xchg_ptr,  # PUSH: [WORLD] int64 exchange buffer addresses (shard.distributed.all_reduce_norm)
    xstate_ptr,  # PUSH: the exchange's int32 state (its call counter picks the slot)
    M,
    N,  # output columns (SILU_MUL: I, half the weight's rows)
    K,
    M_BUCKET,  # autotuning key only (next power of two of M); unused by the code
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_N: tl.constexpr,  # weight rows per program (SILU_MUL: BLOCK_N // 2 outputs)
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    STAGES: tl.constexpr,
    PREFETCH: tl.constexpr = False,  # M == 1: hold the next weight tile in flight (see below)
    PUSH: tl.constexpr = False,
    RANK: tl.constexpr = 0,
    WORLD: tl.constexpr = 1,
    MAX_ROWS: tl.constexpr = 1,
    MAX_HIDDEN: tl.constexpr = 1,
    PDL: tl.constexpr = False,  # launched as a programmatic dependent (shard/kernels/pdl.py)
):
    let_dependents_launch(PDL)
    pid = tl.program_id(0)
    r = tl.arange(0, BLOCK_N)
    if SILU_MUL:
        cols = pid * (BLOCK_N // 2) + r // 2  # [BLOCK_N] output column of each tile row
        rows = cols + (r % 2) * N  # even tile rows: gate, odd: up
    else:
        cols = pid * BLOCK_N + r
        rows = cols
    row_mask = cols < N
    # int64 row offsets: N * K passes 2^31 for vocabulary-sized weights.
    w_rows = w_ptr + rows.to(tl.int64) * stride_wn  # [BLOCK_N] pointers to row starts
    offs_k = tl.arange(0, BLOCK_K)
    if USE_DOT:
        wait_for_predecessor(PDL)  # (the pipelined loop below issues the first weight loads)
        offs_m = tl.arange(0, 16)  # the MMA's row tile; rows >= M are masked (never read)
        m_mask = offs_m < M
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            k = k0 + offs_k
            k_mask = k < K
            # [BLOCK_K, BLOCK_N] view of W's rows (K contiguous): the dot's B operand as is.
            w = tl.load(
                w_rows[None, :] + k[:, None],
                mask=k_mask[:, None] & row_mask[None, :],
                other=0.0,
                eviction_policy="evict_first",
            )
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                mask=m_mask[:, None] & k_mask[None, :],
                other=0.0,
            )  # [16, BLOCK_K]
            # e4m3 values are exact in bf16 and fp16 (and 16-bit weights are x's dtype): the
            # conversion loses nothing.
            acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)  # [16, BLOCK_N] fp32
        acc_rows = acc  # [16, BLOCK_N]: the MMA's row tile
    else:
        # M == 1 (the launcher only picks this path then): one x row, CUDA cores. Each
        # iteration reduces its tile over K at once, so registers hold the loaded weight bytes
        # and a [BLOCK_N] accumulator, not a fp32 copy of the tile: the tile, i.e. the bytes each
        # program has in flight, can be large.
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        if PREFETCH:
            # Register double buffer: tile i + 1's load is issued before tile i's conversion and
            # FMAs, so the program keeps weight bytes in flight while it computes (the plain
            # STAGES=1 loop below stops loading for each tile's compute), for twice the tile's
            # registers. Measured per shape, not assumed: it wins some 16-bit shapes and lost on
            # every fp8 one (the candidate lists). The first tile is loaded before the wait on
            # the previous kernel, as below.
            w = _weight_tile(w_rows, offs_k, row_mask, K)  # [BLOCK_N, BLOCK_K]
            wait_for_predecessor(PDL)
            for k0 in tl.range(0, K, BLOCK_K, num_stages=1):
                # past the last tile the mask is all false: no memory traffic
                w_next = _weight_tile(w_rows, k0 + BLOCK_K + offs_k, row_mask, K)
                k = k0 + offs_k
                x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)  # [BLOCK_K]
                acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
                w = w_next
        else:
            k_first = 0
            if PDL:
                # The first weight tile does not depend on the previous kernel: load it before the
                # wait, so its DRAM latency overlaps that kernel's tail (shard/kernels/pdl.py). x, the
                # previous kernel's output, only after.
                w = _weight_tile(w_rows, offs_k, row_mask, K)  # [BLOCK_N, BLOCK_K]
                wait_for_predecessor(PDL)
                x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
                acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
                k_first = BLOCK_K
            for k0 in tl.range(k_first, K, BLOCK_K, num_stages=STAGES):
                k = k0 + offs_k
                # The weight load first: its HBM latency then overlaps x's (L2) load and the
                # layout shuffle x takes to match w's layout.
                w = _weight_tile(w_rows, k, row_mask, K)  # [BLOCK_N, BLOCK_K]
                x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)  # [BLOCK_K]
                acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        acc_rows = acc[None, :]  # [1, BLOCK_N]
        offs_m = tl.arange(0, 1)
    # (The branches above are compile-time: only the taken one defines acc_rows and offs_m.)
    _epilogue(
        acc_rows,
        offs_m,
        rows,
        row_mask,
        pid,
        s_ptr,
        b_ptr,
        y_ptr,
        xchg_ptr,
        xstate_ptr,
        M,
        N,
        stride_ym,
        acc_rows.shape[0],
        HAS_SCALE,
        HAS_BIAS,
        SILU_MUL,
        BLOCK_N,
        PUSH,
        RANK,
        WORLD,
        MAX_ROWS,
        MAX_HIDDEN,
    )


def _config(
    block_n: int, block_k: int, warps: int, stages: int, use_dot: bool, prefetch: bool = False
) -> triton.Config:
    return triton.Config(
        {"BLOCK_N": block_n, "BLOCK_K": block_k, "USE_DOT": use_dot, "STAGES": stages,
         "PREFETCH": prefetch},
        num_warps=warps,
        num_stages=stages,
    )


# Bytes in flight decide a weight stream's speed: ~26-40 KB per SM at H200 bandwidth and load
# latency. A program has BLOCK_N * BLOCK_K * (bytes per weight) in flight per iteration (in
# registers with STAGES=1, in shared memory for STAGES-1 iterations ahead otherwise), and
# N / BLOCK_N programs share the 132 SMs: N = 4096 with BLOCK_N = 4 is ~8 programs per SM, with
# 16 only ~2.
#
# fp8, M == 1, CUDA cores. In flight per weight row: BLOCK_K bytes (STAGES=1, held in registers,
# 64-128 bytes per thread) or (STAGES-1) * BLOCK_K (cp.async into shared memory); ~1.5-2 KB per
# row keeps N = 4096 near full bandwidth. BLOCK_K = 512 is one warp's width (32 lanes x 16 B), so
# the warps split rows and tl.sum stays inside a warp; wider tiles reduce across warps.
# (A 2 x 2048 config, the bytes of the 16-bit winner below, lost in-graph to these on every
# Llama-3-8B fp8 shape: raw/gemv_sweep_fp8_h200.json.)
_FP8_FMA_CONFIGS = (
    _config(4, 512, 4, 4, False),
    _config(8, 512, 4, 4, False),
    _config(16, 512, 4, 3, False),
    _config(8, 1024, 4, 3, False),
    _config(4, 2048, 4, 1, False),
    _config(8, 2048, 4, 1, False),
    _config(8, 2048, 8, 1, False),
)
# 8 x 2048 with 8 warps won the in-graph sweep for down (16.1 -> 15.5 us) and tied for o
# (raw/gemv_sweep_fp8_prefetch_session6_h200x2.json). The register double buffer (PREFETCH) lost
# on every fp8 shape (e.g. down 4 x 2048: 16.1 -> 18.2 us), so no fp8 candidate uses it.
# (Whole 4096-wide rows, 4 x 4096 and 8 x 4096, were tried as candidates with PDL, where a
# program's first tile is then all of a K = 4096 row: the fp8 step stayed at 2.49 ms; forced
# onto o_proj, or onto q/k/v, o and gate/up, the step got slower: 2.53 -> 2.61 / 2.71 ms.)
# fp8, 2 <= M <= 16, tensor cores (mma.sync m16n8k16; tl.dot needs BLOCK_N >= 16, and num_warps
# <= BLOCK_N / 8 keeps warps from repeating each other's columns). All pipelined; shared memory
# per stage is BLOCK_N * BLOCK_K fp8 + 16 * BLOCK_K x (bf16/fp16): 64-96 KB per program.
_FP8_DOT_CONFIGS = (
    _config(16, 256, 2, 6, True),
    _config(16, 512, 2, 4, True),
    _config(32, 256, 4, 4, True),
    _config(32, 512, 4, 3, True),
)
# 16-bit weights, M == 1: the same bytes per tile as the fp8 ones, i.e. half the elements. A
# 16-byte vector is 8 elements, so one warp's width is BLOCK_K = 256 (the fp8 512); a row's
# 1.5-2 KB in flight is 768-1024 elements. Registers per thread for the raw tile stay 64-128
# bytes (STAGES=1: 8 x 1024 x 2 B / 128 threads). The fp32 conversion is cheaper per byte than
# fp8's (half the elements), so these are further from the CUDA-core instruction limit.
#
# Two rows of 1024 (STAGES=1, 4 warps) were the fastest of a 50-config grid for every TP=2
# Llama-3-8B shape and three of the four TP=1 ones, timed back to back in a CUDA graph as a
# decode step runs them (benchmarks/gemv_config_sweep.py, raw/gemv_sweep_h200x2.json: e.g. TP=2
# gate/up + SiLU 30.7 -> 28.6 us, down 16.5 -> 15.1, qkv 9.2 -> 8.2): twice the programs of
# BLOCK_N 4 for the same bytes each, so the tail of the last wave is shorter. 8 rows with 8
# warps came second.
_W16_FMA_CONFIGS = (
    _config(4, 256, 4, 4, False),
    _config(8, 256, 4, 4, False),
    _config(16, 256, 4, 3, False),
    _config(8, 512, 4, 3, False),
    _config(2, 1024, 4, 1, False),
    _config(4, 1024, 4, 1, False),
    _config(8, 1024, 4, 1, False),
    _config(8, 1024, 8, 1, False),
    # Register double buffer: 2 x 1024 won TP=2 q/k/v (7.94 -> 7.16 us) and 4 x 1024 one-GPU o
    # by a hair (raw/gemv_sweep_bf16_prefetch_session6_h200x2.json); the other shapes keep the
    # plain loop.
    _config(2, 1024, 4, 1, False, prefetch=True),
    _config(4, 1024, 4, 1, False, prefetch=True),
)
# 16-bit weights, 2 <= M <= 16: half fp8's BLOCK_K keeps the weight bytes per stage (BLOCK_N x
# BLOCK_K x 2 B: 8-16 KB); x's [16, BLOCK_K] tile shrinks with it. Each program re-reads x from
# L2 (16 x K x 2 B), as much as a 16-row weight tile: BLOCK_N = 64 halves that traffic for the
# wide shapes. Shared memory per program: 48-80 KB.
_W16_DOT_CONFIGS = (
    _config(16, 256, 2, 4, True),
    _config(32, 128, 4, 6, True),
    _config(32, 256, 4, 3, True),
    _config(64, 128, 4, 4, True),
)


def _families(weight_dtype: torch.dtype) -> tuple[tuple[triton.Config, ...], ...]:
    """(CUDA-core configs, tensor-core configs) of a weight dtype."""
    if weight_dtype == FP8_DTYPE:
        return _FP8_FMA_CONFIGS, _FP8_DOT_CONFIGS
    return _W16_FMA_CONFIGS, _W16_DOT_CONFIGS


def config_dict(config: triton.Config) -> dict[str, Any]:
    """A candidate config as JSON-able data (the tuning cache's files)."""
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps,
            "num_stages": config.num_stages}


def config_from_dict(data: Mapping[str, Any], weight_dtype: torch.dtype) -> triton.Config:
    """The candidate config of `weight_dtype` that config_dict() wrote as `data`; KeyError if no
    candidate matches any more (the candidate lists changed: the cached choice is stale)."""
    for config in (c for family in _families(weight_dtype) for c in family):
        if config_dict(config) == dict(data):
            return config
    raise KeyError(f"no GEMV candidate config {dict(data)} for {weight_dtype}")


# Bump to invalidate every tuning-cache entry for a reason kernel_version() cannot see.
TUNING_VERSION = 1
# The modules whose source decides a tuning result: the kernel and its candidates (this file), its
# PDL and push helpers, and the in-graph timing.
_TUNING_SOURCES = ("gemv.py", "pdl.py", "all_reduce_norm.py", "graph_timing.py")


@functools.cache
def kernel_version() -> str:
    """A digest of everything in shard/kernels a tuned choice depends on (TUNING_VERSION and the
    source of _TUNING_SOURCES: the kernel, its candidate configs, the timing settings): part of
    every tuning-cache key, so that an edited kernel or candidate list is tuned afresh rather
    than served a stale choice. Coarse on purpose (an edited comment retunes too): a retune
    costs seconds, a stale choice a slower or failing kernel."""
    digest = hashlib.sha256(str(TUNING_VERSION).encode())
    here = Path(__file__).parent
    for name in _TUNING_SOURCES:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


def configs_for(m: int, weight_dtype: torch.dtype) -> list[triton.Config]:
    """The autotuning candidates for a batch of m rows and a weight dtype (also what the tests
    run one by one). M == 1 also tries one tensor-core config (wide-N shapes can prefer it)."""
    fma, dot = _families(weight_dtype)
    if m_bucket(m) == 1:
        return [*fma, dot[1]]
    return list(dot)


def _prune(
    configs: list[triton.Config],
    named_args: dict[str, object],
    weight_dtype: torch.dtype,
    **kwargs: object,
) -> list[triton.Config]:
    allowed = {id(c) for c in configs_for(int(named_args["M_BUCKET"]), weight_dtype)}
    return [c for c in configs if id(c) in allowed]


# do_bench settings shared by the autotuner and bench_us (so that a tuned kernel and cuBLAS are
# timed alike): short runs (4-7 candidates per key, each call a few microseconds), L2 cleared
# before every timed call, as a decode step's other layers do to a real one.
_BENCH_WARMUP_MS = 5
_BENCH_REP_MS = 20


def _bench(fn: Callable[[], object], quantiles: Sequence[float]) -> list[float]:
    return triton.testing.do_bench(
        fn, warmup=_BENCH_WARMUP_MS, rep=_BENCH_REP_MS, quantiles=quantiles
    )


def bench_us(fn: Callable[[], object]) -> float:
    """Median microseconds of one call of fn, timed as the autotuner times candidates."""
    ms = triton.testing.do_bench(
        fn, warmup=_BENCH_WARMUP_MS, rep=_BENCH_REP_MS, return_mode="median"
    )
    return 1e3 * ms


def _autotuned(weight_dtype: torch.dtype) -> Autotuner:
    fma, dot = _families(weight_dtype)
    return triton.autotune(
        configs=[*fma, *dot],
        # the tensors' dtypes (x, W, ...) are added to the key by triton
        key=["M_BUCKET", "N", "K", "HAS_BIAS", "SILU_MUL"],
        prune_configs_by={"early_config_prune": partial(_prune, weight_dtype=weight_dtype)},
        do_bench=_bench,
    )(_gemv_kernel)


# One autotuner per candidate family (both over the same kernel).
FP8_TUNED = _autotuned(FP8_DTYPE)
W16_TUNED = _autotuned(torch.bfloat16)


def _tuner(weight_dtype: torch.dtype) -> Autotuner:
    return FP8_TUNED if weight_dtype == FP8_DTYPE else W16_TUNED


def _check(
    caller: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    silu_mul: bool,
) -> None:
    m, k = x.shape
    if not 0 <= m <= GEMV_MAX_M:
        raise ValueError(f"{caller}: {m} rows, at most {GEMV_MAX_M}")
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"{caller}: weight {tuple(weight.shape)} does not fit x {(m, k)}")
    if weight.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"{caller}: weight dtype {weight.dtype}, expected one of {WEIGHT_DTYPES}")
    if (weight.dtype == FP8_DTYPE) != (scale is not None):
        raise ValueError(f"{caller}: a per-channel scale goes with (and only with) fp8 weights")
    rows = weight.shape[0]
    if silu_mul and rows % 2:
        raise ValueError(f"{caller}: silu_mul needs a [2I, K] gate/up weight, got {rows} rows")
    if bias is not None and tuple(bias.shape) != (rows,):
        raise ValueError(f"{caller}: bias {tuple(bias.shape)}, expected ({rows},)")


def gemv(
    x: torch.Tensor,  # [M, K] bf16/fp16, 0 <= M <= GEMV_MAX_M
    weight: torch.Tensor,  # [N, K] (silu_mul: [2I, K]) bf16/fp16/fp8, unit column stride
    scale: torch.Tensor | None = None,  # [N] float32, contiguous; fp8 weights only
    bias: torch.Tensor | None = None,  # [N], contiguous
    *,
    silu_mul: bool = False,
    config: triton.Config | None = None,
    caller: str = "gemv",  # named in error messages
    push_to: ExchangeTarget | None = None,
) -> torch.Tensor:
    """y [M, N] = x @ weight.T (* scale) (+ bias) in x's dtype; silu_mul: y [M, I] = silu(gate)
    * up of the [M, 2I] result.

    config None: the autotuned config for (M bucket, N, K, bias, epilogue, dtypes); the first call
    for a key benchmarks every candidate (host syncs: never while capturing; see tune_gemv).
    Otherwise `config` is launched as given (one of configs_for(M, weight.dtype)).

    push_to (a row-parallel output under tensor parallelism; needs `config`): y is not written
    (returned uninitialized); the result goes into every rank's exchange buffer of that fused
    all-reduce + norm, whose `reduce_pushed` must be the next call on it."""
    _check(caller, x, weight, scale, bias, silu_mul)
    if push_to is not None and (config is None or silu_mul):
        raise ValueError(f"{caller}: push_to needs an explicit config and no silu_mul")
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]  # output columns
    # One layout for every call (unit stride, rows K apart, 16-byte aligned): the compiled
    # specialization then matches the one tune_gemv loaded before any graph capture.
    if x.stride(-1) != 1 or (m > 1 and x.stride(0) != k):
        x = x.contiguous()
    if x.data_ptr() % 16:  # e.g. a column slice: copy into a fresh (aligned) allocation
        x = x.clone()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    outs_per_row = 2 if silu_mul else 1  # weight rows per output column
    args = (
        x,
        weight,
        weight if scale is None else scale,  # valid pointers that are never read
        weight if bias is None else bias,
        y,
        *(push_to.exchange_args()[:2] if push_to is not None else (weight, weight)),
        m,
        n,
        k,
        m_bucket(m),
        k,  # stride_xm: rows of the normalized x are K apart
        weight.stride(0),
        n,  # stride_ym
    )
    # Programmatic dependent launch at batch 1 only: there the first weight tile streams before
    # the wait. The tensor-core path (2 <= M <= 16) waits first, and with PDL the fp8 one
    # measured slower at batch 8 (Llama-3-8B step 4.34 -> 4.58 ms, benchmarks/QUANT_TP.md).
    flags = {"HAS_SCALE": scale is not None, "HAS_BIAS": bias is not None, "SILU_MUL": silu_mul,
             **(pdl.launch_options(x.device) if m == 1 else {"PDL": False})}
    if config is None:
        _tuner(weight.dtype)[lambda meta: (triton.cdiv(n * outs_per_row, meta["BLOCK_N"]),)](
            *args, **flags
        )
        return y
    if not config.kwargs["USE_DOT"] and m != 1:
        raise ValueError(f"{caller}: the CUDA-core config serves one row only")
    grid = (triton.cdiv(n * outs_per_row, config.kwargs["BLOCK_N"]),)
    if push_to is not None:
        flags.update(PUSH=True, **push_to.exchange_args()[2])
    _gemv_kernel[grid](*args, **flags, **config.all_kwargs())
    return y


def load_push_variants(
    weight: torch.Tensor,  # [N, K] 16-bit, the row-parallel weight
    dtype: torch.dtype,  # the activations' dtype
    configs: Sequence[triton.Config],  # every config the shape's buckets launch
    push_to: ExchangeTarget,
) -> None:
    """Compiles and loads the PUSH variant of each config before any CUDA-graph capture (a
    first launch loads a module, which a capturing stream forbids), by launching it with M = 0:
    every store is masked off, so no exchange buffer is written and the protocol's state is
    untouched. Eager only."""
    x = torch.zeros((GEMV_MAX_M, weight.shape[1]), dtype=dtype, device=weight.device)  # [16, K]
    y = torch.empty((GEMV_MAX_M, weight.shape[0]), dtype=dtype, device=weight.device)
    ptrs, state, consts = push_to.exchange_args()
    n = weight.shape[0]
    for config in configs:
        _gemv_kernel[(triton.cdiv(n, config.kwargs["BLOCK_N"]),)](
            x, weight, weight, weight, y, ptrs, state, 0, n, weight.shape[1], 1,
            weight.shape[1], weight.stride(0), n, HAS_SCALE=False, HAS_BIAS=False,
            SILU_MUL=False, PUSH=True, **consts, **pdl.launch_options(weight.device),
            **config.all_kwargs(),  # (pushes are batch-1 only: the PDL variant)
        )


def fastest_in_graph(
    weight: torch.Tensor,  # [N, K] (silu_mul: [2I, K]) 16-bit or fp8
    scale: torch.Tensor | None,  # [N] fp32 for fp8 weights
    bias: torch.Tensor | None,
    dtype: torch.dtype,  # the activations' dtype
    silu_mul: bool,
    candidates: Sequence[triton.Config],  # batch-1 configs (configs_for(1, ...))
) -> tuple[triton.Config, dict[str, float]]:
    """(the candidate with the lowest in-graph time per launch, {config: us} of all)."""
    x = torch.zeros((1, weight.shape[1]), dtype=dtype, device=weight.device)  # [1, K]
    views = weight_views(weight)
    timings: dict[str, float] = {}
    best: tuple[float, triton.Config] | None = None
    for config in candidates:
        try:
            us = time_in_graph_us(
                lambda w, config=config: gemv(x, w, scale, bias, silu_mul=silu_mul, config=config),
                views,
            )
        except triton.runtime.errors.OutOfResources:  # e.g. shared memory: not a candidate here
            us = math.inf
        timings[str(config)] = us
        if best is None or us < best[0]:
            best = (us, config)
    assert best is not None, "no candidates"
    return best[1], timings


def tune_gemv(
    weight: torch.Tensor,  # [N, K] (silu_mul: [2I, K]) bf16/fp16/fp8
    scale: torch.Tensor | None,  # [N] float32 for fp8 weights, else None
    bias: torch.Tensor | None,
    dtype: torch.dtype,  # the activations' dtype
    silu_mul: bool = False,
    *,
    cached: bool = True,
) -> dict[int, triton.Config]:
    """Autotunes (and compiles and loads) the kernel for every M bucket of this weight shape,
    bias-ness, epilogue and activation dtype; returns each bucket's config. Batch 1's config is
    then re-chosen by timing the candidates back to back in a CUDA graph, as a decode step runs
    them (shard/kernels/graph_timing.py). Eager only: it benchmarks with host syncs. Keys already
    tuned (other layers of the same shape) cost one launch each, which also loads the kernel on
    this weight's device.

    cached (CUDA): the configs come from the process's tuning cache (shard/kernels/tuning_cache.py)
    when a peer rank or an earlier run stored them, and are stored there after tuning; only their
    kernels are then loaded. decode_linear passes False: it caches its whole record itself."""
    if not weight.is_cuda or not cached:
        return _autotune(weight, scale, bias, dtype, silu_mul)
    memo = (tuple(weight.shape), weight.dtype, dtype, bias is not None, silu_mul,
            weight.device.index, pdl.enabled(weight.device))
    chosen = _CACHED_CONFIGS.get(memo)
    if chosen is None:
        chosen = tuning_cache.cached_tuning(
            tuning_key("gemv_configs", weight, dtype, bias is not None, silu_mul),
            lambda: _autotune(weight, scale, bias, dtype, silu_mul),
            lambda configs: {"buckets": {str(b): config_dict(c) for b, c in configs.items()}},
            functools.partial(decode_bucket_configs, weight_dtype=weight.dtype),
        )
        _CACHED_CONFIGS[memo] = chosen
    load_configs(weight, scale, bias, dtype, silu_mul, chosen)
    return chosen


def _autotune(
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    silu_mul: bool,
) -> dict[int, triton.Config]:
    k = weight.shape[1]
    x = torch.zeros((GEMV_MAX_M, k), dtype=dtype, device=weight.device)  # [16, K]
    tuner = _tuner(weight.dtype)
    chosen = {}
    for bucket in M_BUCKETS:
        gemv(x[:bucket], weight, scale, bias, silu_mul=silu_mul)
        chosen[bucket] = tuner.best_config  # set by the launch just made
    if not weight.is_cuda:  # the interpreter on CPU: no graphs to time in
        return chosen
    key = (tuple(weight.shape), weight.dtype, dtype, bias is not None, silu_mul,
           weight.device.index, pdl.enabled(weight.device))
    if key not in _GRAPH_PICKS:
        _GRAPH_PICKS[key] = fastest_in_graph(weight, scale, bias, dtype, silu_mul,
                                             configs_for(1, weight.dtype))[0]
    chosen[1] = _GRAPH_PICKS[key]
    return chosen


def load_configs(
    weight: torch.Tensor,  # [N, K] (silu_mul: [2I, K])
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    dtype: torch.dtype,  # the activations' dtype
    silu_mul: bool,
    configs: Mapping[int, triton.Config],  # {M bucket: config}
) -> None:
    """Compiles (from Triton's on-disk cache when it has them) and loads each bucket's config on
    the weight's device by one eager launch at that bucket's batch (batch 1 with its PDL
    variant), then syncs so that a failing launch raises here, not in a graph capture: what a
    cached choice needs before any CUDA graph is captured."""
    x = torch.zeros((GEMV_MAX_M, weight.shape[1]), dtype=dtype, device=weight.device)  # [16, K]
    for bucket, config in configs.items():
        gemv(x[:bucket], weight, scale, bias, silu_mul=silu_mul, config=config,
             caller="gemv.load_configs")
    torch.cuda.synchronize(weight.device)


def decode_bucket_configs(
    raw: Mapping[str, Any], weight_dtype: torch.dtype
) -> dict[int, triton.Config]:
    """{M bucket: config} from a tuning-cache value {"buckets": {"1": config_dict, ...}};
    raises (KeyError / ValueError) unless it names a candidate of the right kind for every
    bucket of M_BUCKETS."""
    buckets = raw["buckets"]
    if sorted(int(b) for b in buckets) != sorted(M_BUCKETS):
        raise ValueError(f"buckets {sorted(buckets)}, expected {list(M_BUCKETS)}")
    chosen = {}
    for bucket in M_BUCKETS:
        config = config_from_dict(buckets[str(bucket)], weight_dtype)
        if not any(config is c for c in configs_for(bucket, weight_dtype)):
            raise ValueError(f"config {config} is not a candidate for batch {bucket}")
        chosen[bucket] = config
    return chosen


def tuning_key(
    op: str, weight: torch.Tensor, dtype: torch.dtype, has_bias: bool, silu_mul: bool
) -> dict[str, str | int | bool]:
    """The tuning-cache key of a GEMV shape's choice on the weight's device: everything the
    answer depends on (the GPU model and software builds, the kernel's source and candidates,
    the weight's shape, dtype and row stride, the activation dtype, bias, epilogue, PDL and the
    batch buckets). `op` names what is stored under it."""
    return {
        "op": op,
        "kernel": kernel_version(),
        **tuning_cache.device_key(weight.device),
        "weight_dtype": str(weight.dtype),  # the quantization kind: bf16 / fp16 / fp8 e4m3
        "dtype": str(dtype),
        "rows": weight.shape[0],
        "k": weight.shape[1],
        "row_stride": weight.stride(0),
        "bias": has_bias,
        "silu_mul": silu_mul,
        "pdl": pdl.enabled(weight.device),
        "buckets": ",".join(str(b) for b in M_BUCKETS),
    }


# tune_gemv's choices read from (or stored into) the tuning cache in this process, per (weight
# shape, weight dtype, activation dtype, bias, epilogue, device, PDL): a model's 32 layers of one
# shape read the cache once.
_CACHED_CONFIGS: dict[tuple, dict[int, triton.Config]] = {}


# Batch-1 configs chosen in-graph by tune_gemv, per (weight shape, weight dtype, activation
# dtype, bias, epilogue, device, PDL): module-level like the autotuner's own cache, so that the
# 32 layers of a shape are timed once.
_GRAPH_PICKS: dict[tuple, triton.Config] = {}
