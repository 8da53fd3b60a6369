"""int8 x int8 GEMM with a fused rescale epilogue for the W8A8-int8 linears (CUDA, Triton):

    y[m, n] = float(sum_k xq[m, k] * wq[n, k]) * a_scale[m] * w_scale[n] (+ bias[n])

xq [M, K] int8 (per-token quantized activations, shard/kernels/int8_quant.py), wq [N, K] int8 as
stored (no relayout: K-major is the operand layout the int8 MMA wants for both sides), y in the
activations' dtype. The sums are exact (int8 tl.dot accumulates in int32 on Ampere / Hopper);
the epilogue multiplies in float32 in the same order as the torch form (w8a8.W8A8Linear on CPU),
so the two differ at most by the output's own rounding.

Why: through torch._int_mm the W8A8 layer was 8-10x slower than bf16 on an H100 (the ~10 eager
ops around the GEMM) and the cuBLASLt int8 GEMM itself no faster than bf16 at the Llama-3-8B
shapes (benchmarks/raw/round10/w8a8/w8a8.log). Here the rescale, bias and output cast live in the
GEMM's epilogue: a W8A8 linear is two launches (quantize, GEMM). For a merged gate/up weight the
epilogue can also apply SiLU-and-mul (SILU_MUL: a tile's weight rows interleave gate and up rows,
as in shard/kernels/gemv.py), saving the [M, 2I] intermediate's write and read and one launch.

Tiles per batch bucket (M_BUCKETS): decode batches (<= 16 rows: one 16-row MMA tile, narrow
BLOCK_N so that the N / BLOCK_N programs cover the SMs: a weight stream), 17-128, 129-512, and
prefill. Each bucket's config is measured at warm-up among a few candidates (`tune_int8_gemm`,
eager, through the shared tuning cache, shard/kernels/tuning_cache.py) and then launched as given:
no autotuning and no host sync in a launch, so CUDA graphs capture it. Programs are ordered in
groups of GROUP_M row tiles so that a group's weight tiles are reused from L2.

RAW (int8_mm): the same kernel writes the int32 sums instead (tests of exactness, and the
benchmark's GEMM-alone timing against torch._int_mm).

Imported only where Triton is; the kernel also runs under TRITON_INTERPRET=1 on CPU tensors
(tests/shard/test_triton_w8a8_interpreter.py).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from shard.kernels import tuning_cache

# Batch buckets: a batch of M rows runs the config of the first bucket >= M (the last one, None,
# takes every larger batch); each is tuned at TUNE_M[bucket] rows.
M_BUCKETS: tuple[int | None, ...] = (16, 64, 128, 512, None)
TUNE_M: dict[int | None, int] = {16: 16, 64: 64, 128: 128, 512: 256, None: 2048}


def m_bucket(m: int) -> int | None:
    for bucket in M_BUCKETS:
        if bucket is None or m <= bucket:
            return bucket
    return None


@triton.jit(do_not_specialize=["M"])
def _int8_gemm_kernel(
    a_ptr,  # [M, K] int8, rows stride_am apart, unit column stride
    b_ptr,  # [N, K] int8, rows stride_bn apart, unit column stride
    as_ptr,  # [M] float32 (read unless RAW)
    bs_ptr,  # [N] float32 (read unless RAW)
    bias_ptr,  # [N] any float dtype (read when HAS_BIAS)
    c_ptr,  # [M, N] the activations' dtype (RAW: int32), rows stride_cm apart
    M,
    N,  # output columns (SILU_MUL: I, half the weight's rows)
    K,
    stride_am,
    stride_bn,
    stride_cm,
    RAW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,  # weight [2I, K] = gate rows then up rows; y = silu(gate) * up
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks in the main loop
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    OUT_N: tl.constexpr,  # output columns per tile: BLOCK_N (SILU_MUL: BLOCK_N // 2)
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, OUT_N)
    # Grouped order: GROUP_M row tiles walk the column tiles together (L2 reuse of weight tiles).
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r = tl.arange(0, BLOCK_N)
    if SILU_MUL:
        # Tile row 2j: gate row c_j, 2j + 1: up row I + c_j (c_j the tile's j-th output column),
        # so the epilogue pairs them by splitting the tile's last axis.
        cols = pid_n * OUT_N + r // 2  # [BLOCK_N] output column of each weight row
        rows_n = cols + (r % 2) * N
    else:
        cols = pid_n * BLOCK_N + r
        rows_n = cols
    n_mask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range rows / columns read row 0 (valid memory) instead of masking every load; their
    # results are never stored.
    rows_a = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rows_b = tl.where(n_mask, rows_n, 0).to(tl.int64)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + rows_b[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0)
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)  # exact int32 sums
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    c_rows = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm
    if RAW:
        tl.store(c_rows + cols[None, :], acc, mask=(offs_m < M)[:, None] & n_mask[None, :])
    else:
        out_ty = c_ptr.dtype.element_ty
        a_scale = tl.load(as_ptr + offs_m, mask=offs_m < M, other=0.0)  # [BLOCK_M]
        b_scale = tl.load(bs_ptr + rows_n, mask=n_mask, other=0.0)  # [BLOCK_N]
        # The torch form's order: (float(acc) * a_scale) * w_scale, then + bias.
        y = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            # Roundings as the unfused path (this GEMM's output in the model dtype, then
            # elementwise.silu_mul): gate and up rounded, silu(gate) rounded, the product rounded.
            y = y.to(out_ty).to(tl.float32)
            g, u = tl.split(tl.reshape(y, [BLOCK_M, OUT_N, 2]))  # [BLOCK_M, OUT_N] each
            a = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
            y = a * u
        offs_out = pid_n * OUT_N + tl.arange(0, OUT_N)
        tl.store(c_rows + offs_out[None, :], y.to(out_ty),
                 mask=(offs_m < M)[:, None] & (offs_out < N)[None, :])


def _config(bm: int, bn: int, bk: int, warps: int, stages: int, group: int = 8) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group},
                         num_warps=warps, num_stages=stages)


# Candidates per bucket (shared memory per stage: (BLOCK_M + BLOCK_N) * BLOCK_K bytes; an H100
# has 227 KB). Decode: one 16-row tile, the weight streamed by N / BLOCK_N programs (4096 / 32 =
# 128 programs for the narrowest shapes, ~1 per SM); 17-512: 64-128-row tiles; prefill: the
# large tiles of a compute-bound GEMM.
CONFIGS: dict[int | None, tuple[triton.Config, ...]] = {
    16: (_config(16, 32, 256, 4, 4), _config(16, 64, 256, 4, 4), _config(16, 64, 128, 4, 5),
         _config(16, 128, 128, 4, 4), _config(16, 32, 512, 4, 3)),
    # 17-64 rows: still a pass over the weight (H100, gate_up at M = 64: the 128-row bucket's
    # best tile took 117 us, 2.4x torch._int_mm); thin N tiles keep ~1 program per SM streaming
    64: (_config(64, 32, 256, 4, 4), _config(64, 64, 256, 4, 4), _config(32, 64, 256, 4, 4),
         _config(64, 64, 128, 4, 5), _config(32, 32, 512, 4, 3)),
    128: (_config(32, 64, 256, 4, 4), _config(64, 64, 256, 4, 4), _config(64, 128, 128, 4, 4),
          _config(128, 64, 128, 4, 4), _config(128, 128, 128, 8, 4)),
    # 256 rows x N = 4096 (o, down): 64 x 64 tiles give 256 programs, 128 x 128 only 64
    512: (_config(64, 128, 128, 4, 4), _config(64, 64, 256, 4, 4), _config(128, 128, 128, 8, 4),
          _config(128, 256, 128, 8, 3), _config(128, 128, 256, 8, 3)),
    None: (_config(128, 128, 128, 8, 4), _config(128, 256, 128, 8, 3),
           _config(256, 128, 128, 8, 3), _config(128, 128, 256, 8, 3)),
}


def _check(xq: torch.Tensor, wq: torch.Tensor) -> None:
    if xq.dtype != torch.int8 or wq.dtype != torch.int8 or xq.dim() != 2 or wq.dim() != 2:
        raise ValueError(f"int8_gemm: int8 [M, K] and [N, K] operands, got {xq.dtype} "
                         f"{tuple(xq.shape)} and {wq.dtype} {tuple(wq.shape)}")
    if xq.shape[1] != wq.shape[1]:
        raise ValueError(f"int8_gemm: x has K={xq.shape[1]}, the weight K={wq.shape[1]}")
    if xq.stride(1) != 1 or wq.stride(1) != 1:
        raise ValueError("int8_gemm: operands need a unit column stride")


def _launch(xq: torch.Tensor, wq: torch.Tensor, a_scale: torch.Tensor | None,
            w_scale: torch.Tensor | None, bias: torch.Tensor | None, out: torch.Tensor,
            config: triton.Config, silu_mul: bool = False) -> None:
    m, k = xq.shape
    n = out.shape[1]  # output columns
    if m == 0 or n == 0:
        return
    kw = config.kwargs
    out_n = kw["BLOCK_N"] // 2 if silu_mul else kw["BLOCK_N"]
    grid = (triton.cdiv(m, kw["BLOCK_M"]) * triton.cdiv(n, out_n),)
    raw = a_scale is None
    _int8_gemm_kernel[grid](
        xq, wq,
        wq if raw else a_scale,  # valid pointers that are never read
        wq if raw else w_scale,
        wq if bias is None else bias,
        out, m, n, k, xq.stride(0), wq.stride(0), out.stride(0),
        RAW=raw, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, EVEN_K=k % kw["BLOCK_K"] == 0,
        OUT_N=out_n,
        **config.all_kwargs(),
    )


def int8_gemm(
    xq: torch.Tensor,  # [M, K] int8, unit column stride
    a_scale: torch.Tensor,  # [M] float32
    wq: torch.Tensor,  # [N, K] int8, unit column stride
    w_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,  # [N] or None
    out_dtype: torch.dtype,
    config: triton.Config | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """y [M, N] in out_dtype (module docstring); silu_mul (a merged gate/up weight [2I, K], rows
    0..I-1 gate, I..2I-1 up): y [M, I] = silu(gate) * up, the roundings of the unfused form.
    config None: the first candidate of M's bucket (tests); the W8A8 layer passes its tuned one."""
    _check(xq, wq)
    m, n = xq.shape[0], wq.shape[0]
    if silu_mul and n % 2:
        raise ValueError(f"int8_gemm: silu_mul needs a [2I, K] gate/up weight, got {n} rows")
    out = torch.empty((m, n // 2 if silu_mul else n), dtype=out_dtype, device=xq.device)
    _launch(xq, wq, a_scale, w_scale, bias, out, config or CONFIGS[m_bucket(m)][0], silu_mul)
    return out


def int8_mm(xq: torch.Tensor, wq: torch.Tensor,
            config: triton.Config | None = None) -> torch.Tensor:
    """xq [M, K] int8 @ wq [N, K].T int8 -> [M, N] int32, exact (the GEMM without epilogue)."""
    _check(xq, wq)
    out = torch.empty((xq.shape[0], wq.shape[0]), dtype=torch.int32, device=xq.device)
    _launch(xq, wq, None, None, None, out, config or CONFIGS[m_bucket(xq.shape[0])][0])
    return out


# ------------------------------------------------------------------------------------ tuning


@functools.cache
def kernel_version() -> str:
    """Hash of this file (kernel source and candidates): a tuning-cache key part."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def config_dict(config: triton.Config) -> dict[str, int]:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def config_from_dict(raw: Mapping[str, Any], bucket: int | None) -> triton.Config:
    """The candidate of `bucket` equal to `raw` (raises ValueError if none is)."""
    for config in CONFIGS[bucket]:
        if config_dict(config) == dict(raw):
            return config
    raise ValueError(f"{dict(raw)} is not a candidate for bucket {bucket}")


def _bucket_name(bucket: int | None) -> str:
    return "prefill" if bucket is None else str(bucket)


def _measure(wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
             dtype: torch.dtype) -> dict[int | None, triton.Config]:
    """Times every candidate of every bucket at TUNE_M rows (do_bench: eager, host syncs);
    the fastest of each bucket. Candidates that do not fit (shared memory) are skipped."""
    k = wq.shape[1]
    chosen: dict[int | None, triton.Config] = {}
    for bucket in M_BUCKETS:
        m = TUNE_M[bucket]
        xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=wq.device)
        a_scale = torch.rand(m, device=wq.device) * 1e-2
        best: tuple[float, triton.Config] | None = None
        for config in CONFIGS[bucket]:
            def call(config: triton.Config = config, xq: torch.Tensor = xq,
                     a_scale: torch.Tensor = a_scale) -> torch.Tensor:
                return int8_gemm(xq, a_scale, wq, w_scale, bias, dtype, config)

            try:
                us = 1e3 * triton.testing.do_bench(call, warmup=5, rep=20, return_mode="median")
            except triton.runtime.errors.OutOfResources:
                us = math.inf
            if best is None or us < best[0]:
                best = (us, config)
        assert best is not None
        chosen[bucket] = best[1]
    return chosen


def tune_int8_gemm(
    wq: torch.Tensor,  # [N, K] int8
    w_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,
    dtype: torch.dtype,  # the activations' (output) dtype
    silu_mul: bool = False,
) -> dict[int | None, triton.Config]:
    """{bucket: config} for this weight shape, bias-ness and dtype: measured (or read from the
    process's tuning cache, shard/kernels/tuning_cache.py), then each config compiled and loaded
    (with the epilogue asked for) by one eager launch and a sync, so a CUDA-graph capture finds
    them ready. Eager only.
    On CPU tensors (the interpreter) each bucket's first candidate, nothing timed.

    silu_mul: the plain epilogue's choice (tuned first if need be; the SiLU-and-mul epilogue is a
    small part of a tile's time), only loaded with the SiLU-and-mul epilogue: half the compiles."""
    if silu_mul and wq.is_cuda:
        chosen = tune_int8_gemm(wq, w_scale, bias, dtype, silu_mul=False)
    elif not wq.is_cuda:
        chosen = {bucket: CONFIGS[bucket][0] for bucket in M_BUCKETS}
    else:
        memo = (tuple(wq.shape), wq.stride(0), dtype, bias is not None, wq.device.index)
        chosen = _CHOSEN.get(memo)
        if chosen is None:
            key = {"op": "int8_gemm_configs", "kernel": kernel_version(),
                   **tuning_cache.device_key(wq.device), "n": wq.shape[0], "k": wq.shape[1],
                   "row_stride": wq.stride(0), "dtype": str(dtype), "bias": bias is not None}
            chosen = tuning_cache.cached_tuning(
                key,
                lambda: _measure(wq, w_scale, bias, dtype),
                lambda c: {_bucket_name(b): config_dict(cfg) for b, cfg in c.items()},
                lambda raw: {b: config_from_dict(raw[_bucket_name(b)], b) for b in M_BUCKETS},
            )
            _CHOSEN[memo] = chosen
    for bucket, config in chosen.items():
        m = min(TUNE_M[bucket], 16)
        xq = torch.zeros((m, wq.shape[1]), dtype=torch.int8, device=wq.device)
        a_scale = torch.ones(m, device=wq.device)
        int8_gemm(xq, a_scale, wq, w_scale, bias, dtype, config, silu_mul)
    if wq.is_cuda:
        torch.cuda.synchronize(wq.device)
    return chosen


# Chosen configs per (weight shape, row stride, dtype, bias, device) in this process: a model's
# 32 layers of one shape are tuned (or read from the cache) once.
_CHOSEN: dict[tuple, dict[int | None, triton.Config]] = {}
