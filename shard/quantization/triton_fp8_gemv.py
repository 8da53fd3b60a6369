"""Weight-only fp8 matmul for decode-sized batches (CUDA sm_89+, Triton).

y[M, N] = (x[M, K] @ dequant(W[N, K]).T) * scale[N] (+ bias), x bf16/fp16, W float8_e4m3fn with
one fp32 scale per output channel (fp8.Fp8Linear's layout), y in x's dtype.

Why: at decode batch sizes a linear layer is a pass over its weight bytes and nothing else; the
W8A8 path (per-token activation quantization + torch._scaled_mm, a GEMM tiled for large M) spends
more on its second kernel and its tiling than it saves by halving the bytes. Here one kernel
streams the fp8 weight once, converts it in registers and accumulates in fp32; the per-channel
scale is applied once to each output in the epilogue.

Design (memory-bound: what matters is bytes in flight, ~26-40 KB per SM on an H200):
- Each program owns BLOCK_N output channels and loops over the whole K. No split-K: the 8B
  shapes give 128..7168 programs with BLOCK_N 4..32, several per SM, and split-K would need an
  atomic-add output zeroed by one more kernel per linear. Small N (unfused k/v projections,
  N = 1024) gets only ~2 programs per SM and streams well below bandwidth: fuse such
  projections (fp8.Fp8Linear.merge_rows) instead.
- M == 1 (`USE_DOT=False`): CUDA cores. Each iteration converts its [BLOCK_N, BLOCK_K] tile
  to fp32, multiplies by the x row and reduces over K into a [BLOCK_N] accumulator right away, so
  registers hold only the raw fp8 bytes in flight (4 per register), not an fp32 copy of the tile.
- 2 <= M <= 16 (`USE_DOT=True`): tensor cores. The x rows are padded to the MMA's 16-row tile
  (masked loads, nothing read from memory for padding rows) and
  tl.dot(x [16, BLOCK_K], w.to(x dtype) [BLOCK_K, BLOCK_N]) accumulates in fp32. On CUDA cores
  each weight element would cost M FMAs plus its conversion; at ~4.3 TB/s an SM can spend only
  ~7.8 thread instructions per weight byte, exceeded from M ~ 4 on, while the MMA absorbs all
  16 rows at the same conversion cost. The 16-row tile is also why GEMV_MAX_M is 16: a larger
  batch needs a second row tile (the weight read twice, or a GEMM's tiling), which is what
  torch._scaled_mm already does well there.
- Loads are software-pipelined through shared memory with cp.async (`tl.range(...,
  num_stages=STAGES)`, which also pipelines loads that feed no dot) or, with STAGES=1, issued as
  16-byte vector loads straight into registers; weight loads are marked evict-first (read once).
  The autotuner picks per (M bucket, N, K, bias, dtypes).

CUDA graphs: everything a launch needs must be compiled and loaded before capture (Triton's
first launch loads a module, which a capturing stream forbids) and autotuning benchmarks with
host syncs, so `tune_fp8_gemv` runs every M bucket eagerly once per (weight shape, bias, dtype);
fp8.Fp8Linear calls it at its first eager forward. After that a launch allocates only the output
and never syncs. `fp8_gemv` normalizes x (unit column stride, rows K apart, 16-byte aligned) so
that capture-time calls hit the same compiled specialization as the tuning calls.

Imported only on CUDA (Triton is not a CPU dependency); the kernel itself also runs under
TRITON_INTERPRET=1 on CPU tensors (see tests/shard/test_quantization.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

# Largest batch (rows of x) served by the GEMV: one 16-row MMA tile (see the module docstring).
GEMV_MAX_M = 16
# Autotuning buckets: a batch of M rows is tuned as the next power of two (CUDA-graph decode
# buckets are 1, 2, 4, 8, 16 already).
M_BUCKETS = (1, 2, 4, 8, 16)


def m_bucket(m: int) -> int:
    """Autotuning bucket of a batch of m rows (1 <= m <= GEMV_MAX_M): the next power of two."""
    return 1 << max(m - 1, 0).bit_length()


@triton.jit
def _store_output(
    acc,  # [ROWS, BLOCK_N] fp32, x @ w_fp8.T before scaling
    offs_m,  # [ROWS] row indices
    offs_n,  # [BLOCK_N] output-channel indices
    n_mask,  # [BLOCK_N]
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    stride_ym,
    HAS_BIAS: tl.constexpr,
):
    scale = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)  # [BLOCK_N] fp32
    y = acc * scale[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = (offs_m[:, None] < M) & n_mask[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _fp8_gemv_kernel(
    x_ptr,  # [M, K] bf16/fp16, rows stride_xm apart, unit column stride
    w_ptr,  # [N, K] float8_e4m3fn, rows stride_wn apart, unit column stride
    s_ptr,  # [N] float32, per output channel
    b_ptr,  # [N] any float dtype; read only when HAS_BIAS
    y_ptr,  # [M, N] x's dtype, rows stride_ym apart
    M,
    N,
    K,
    M_BUCKET,  # autotuning key only (next power of two of M); unused by the code
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = offs_n < N
    # int64 row offsets: N * K passes 2^31 for vocabulary-sized weights.
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn  # [BLOCK_N] pointers to row starts
    offs_k = tl.arange(0, BLOCK_K)
    if USE_DOT:
        offs_m = tl.arange(0, 16)  # the MMA's row tile; rows >= M are masked (never read)
        m_mask = offs_m < M
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            k = k0 + offs_k
            k_mask = k < K
            # [BLOCK_K, BLOCK_N] view of W's rows (K contiguous): the dot's B operand as is.
            w = tl.load(
                w_rows[None, :] + k[:, None],
                mask=k_mask[:, None] & n_mask[None, :],
                other=0.0,
                eviction_policy="evict_first",
            )
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                mask=m_mask[:, None] & k_mask[None, :],
                other=0.0,
            )  # [16, BLOCK_K]
            # e4m3 values are exact in bf16 and fp16: the conversion loses nothing.
            acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)  # [16, BLOCK_N] fp32
        _store_output(acc, offs_m, offs_n, n_mask, s_ptr, b_ptr, y_ptr, M, stride_ym, HAS_BIAS)
    else:
        # M == 1 (the launcher only picks this path then): one x row, CUDA cores. Each
        # iteration reduces its tile over K at once, so registers hold the loaded fp8 bytes
        # (4 per register) and a [BLOCK_N] accumulator, not a fp32 copy of the tile: the tile,
        # i.e. the bytes each program has in flight, can be large.
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            k = k0 + offs_k
            k_mask = k < K
            # The weight load first: its HBM latency then overlaps x's (L2) load and the
            # layout shuffle x takes to match w's layout.
            w = tl.load(
                w_rows[:, None] + k[None, :],
                mask=n_mask[:, None] & k_mask[None, :],
                other=0.0,
                eviction_policy="evict_first",  # read once: keep the caches for x
            )  # [BLOCK_N, BLOCK_K] fp8
            x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        offs_m = tl.arange(0, 1)
        _store_output(
            acc[None, :], offs_m, offs_n, n_mask, s_ptr, b_ptr, y_ptr, M, stride_ym, HAS_BIAS
        )


def _config(block_n: int, block_k: int, warps: int, stages: int, use_dot: bool) -> triton.Config:
    return triton.Config(
        {"BLOCK_N": block_n, "BLOCK_K": block_k, "USE_DOT": use_dot, "STAGES": stages},
        num_warps=warps,
        num_stages=stages,
    )


# Bytes in flight decide a weight stream's speed: ~26-40 KB per SM at H200 bandwidth and load
# latency. A program has BLOCK_N * BLOCK_K weight bytes in flight per iteration (in registers with
# STAGES=1, in shared memory for STAGES-1 iterations ahead otherwise), and N / BLOCK_N programs
# share the 132 SMs: N = 4096 with BLOCK_N = 4 is ~8 programs per SM, with 16 only ~2.
#
# M == 1, CUDA cores. In flight per output row: BLOCK_K bytes (STAGES=1, held in registers,
# 64-128 bytes per thread) or (STAGES-1) * BLOCK_K (cp.async into shared memory); ~1.5-2 KB per
# row keeps N = 4096 near full bandwidth. BLOCK_K = 512 is one warp's width (32 lanes x 16 B), so
# the warps split rows and tl.sum stays inside a warp; wider tiles reduce across warps.
_FMA_CONFIGS = (
    _config(4, 512, 4, 4, False),
    _config(8, 512, 4, 4, False),
    _config(16, 512, 4, 3, False),
    _config(8, 1024, 4, 3, False),
    _config(4, 2048, 4, 1, False),
    _config(8, 2048, 4, 1, False),
)
# 2 <= M <= 16, tensor cores (mma.sync m16n8k16; tl.dot needs BLOCK_N >= 16, and num_warps <=
# BLOCK_N / 8 keeps warps from repeating each other's columns). All pipelined; shared memory per
# stage is BLOCK_N * BLOCK_K fp8 + 16 * BLOCK_K x (bf16/fp16): 64-96 KB per program.
_DOT_CONFIGS = (
    _config(16, 256, 2, 6, True),
    _config(16, 512, 2, 4, True),
    _config(32, 256, 4, 4, True),
    _config(32, 512, 4, 3, True),
)


def configs_for(m: int) -> list[triton.Config]:
    """The autotuning candidates for a batch of m rows (also what the tests run one by one)."""
    if m_bucket(m) == 1:
        return [*_FMA_CONFIGS, _DOT_CONFIGS[1]]
    return list(_DOT_CONFIGS)


def _prune(
    configs: list[triton.Config], named_args: dict[str, object], **kwargs: object
) -> list[triton.Config]:
    allowed = {id(c) for c in configs_for(int(named_args["M_BUCKET"]))}
    return [c for c in configs if id(c) in allowed]


def _bench(fn: Callable[[], object], quantiles: Sequence[float]) -> list[float]:
    # Short runs (4-7 candidates per key, each call a few microseconds). do_bench clears L2
    # before every timed call, as a decode step's other layers do to a real one.
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


_fp8_gemv_tuned = triton.autotune(
    configs=[*_FMA_CONFIGS, *_DOT_CONFIGS],
    key=["M_BUCKET", "N", "K", "HAS_BIAS"],  # the tensors' dtypes are added by triton
    prune_configs_by={"early_config_prune": _prune},
    do_bench=_bench,
)(_fp8_gemv_kernel)


def fp8_gemv(
    x: torch.Tensor,  # [M, K] bf16/fp16, CUDA, 1 <= M <= GEMV_MAX_M
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, unit column stride
    scale: torch.Tensor,  # [N] float32, contiguous
    bias: torch.Tensor | None = None,  # [N], contiguous
    config: triton.Config | None = None,
) -> torch.Tensor:
    """y [M, N] = (x @ weight.float().T) * scale (+ bias), in x's dtype.

    config None: the autotuned config for (M bucket, N, K, bias, dtypes); the first call for a
    key benchmarks every candidate (host syncs: never while capturing; see tune_fp8_gemv).
    Otherwise `config` is launched as given (one of configs_for(M)).
    """
    m, k = x.shape
    n = weight.shape[0]
    if not 0 <= m <= GEMV_MAX_M:
        raise ValueError(f"fp8_gemv: {m} rows, at most {GEMV_MAX_M}")
    if weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"fp8_gemv: weight {tuple(weight.shape)} does not fit x {(m, k)}")
    # One layout for every call (unit stride, rows K apart, 16-byte aligned): the compiled
    # specialization then matches the one tune_fp8_gemv loaded before any graph capture.
    if x.stride(-1) != 1 or (m > 1 and x.stride(0) != k):
        x = x.contiguous()
    if x.data_ptr() % 16:  # e.g. a column slice: copy into a fresh (aligned) allocation
        x = x.clone()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bucket = m_bucket(m)
    args = (
        x,
        weight,
        scale,
        scale if bias is None else bias,  # a valid pointer that is never read
        y,
        m,
        n,
        k,
        bucket,
        k,  # stride_xm: rows of the normalized x are K apart
        weight.stride(0),
        n,  # stride_ym
    )
    if config is None:
        _fp8_gemv_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
            *args, HAS_BIAS=bias is not None
        )
        return y
    if not config.kwargs["USE_DOT"] and m != 1:
        raise ValueError("fp8_gemv: the CUDA-core config serves one row only")
    block_n = config.kwargs["BLOCK_N"]
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        *args, HAS_BIAS=bias is not None, **config.all_kwargs()
    )
    return y


def tune_fp8_gemv(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,
    dtype: torch.dtype,  # the activations' dtype
) -> None:
    """Autotunes (and compiles and loads) the kernel for every M bucket of this weight shape,
    bias-ness and activation dtype. Eager only: it benchmarks with host syncs. Keys already tuned
    (other layers of the same shape) cost one launch each."""
    k = weight.shape[1]
    x = torch.zeros((GEMV_MAX_M, k), dtype=dtype, device=weight.device)  # [16, K]
    for bucket in M_BUCKETS:
        fp8_gemv(x[:bucket], weight, scale, bias)
