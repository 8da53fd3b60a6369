"""Weight-only fp8 matmul for decode-sized batches (CUDA sm_89+, Triton): the fp8 front of
shard/kernels/gemv.py, whose docstring gives the design.

y[M, N] = (x[M, K] @ dequant(W[N, K]).T) * scale[N] (+ bias), x bf16/fp16, W float8_e4m3fn with
one fp32 scale per output channel (fp8.Fp8Linear's layout), y in x's dtype.

Why: at decode batch sizes a linear layer is a pass over its weight bytes and nothing else; the
W8A8 path (per-token activation quantization + torch._scaled_mm, a GEMM tiled for large M) spends
more on its second kernel and its tiling than it saves by halving the bytes. Here one kernel
streams the fp8 weight once, converts it in registers and accumulates in fp32; the per-channel
scale is applied once to each output in the epilogue.

CUDA graphs: `tune_fp8_gemv` runs every M bucket eagerly once per (weight shape, bias, dtype);
fp8.Fp8Linear calls it at its first eager forward. After that a launch allocates only the output
and never syncs.

Imported only on CUDA (Triton is not a CPU dependency); the kernel itself also runs under
TRITON_INTERPRET=1 on CPU tensors (see tests/shard/test_quantization.py).
"""

from __future__ import annotations

import torch
import triton

from shard.kernels import gemv as gemv_kernel
from shard.kernels.gemv_buckets import GEMV_MAX_M, M_BUCKETS, m_bucket

__all__ = ["GEMV_MAX_M", "M_BUCKETS", "configs_for", "fp8_gemv", "m_bucket", "tune_fp8_gemv"]

# The autotuner of the fp8 candidates (benchmarks read its .cache of chosen configs).
_fp8_gemv_tuned = gemv_kernel.FP8_TUNED


def configs_for(m: int) -> list[triton.Config]:
    """The autotuning candidates for a batch of m rows (also what the tests run one by one)."""
    return gemv_kernel.configs_for(m, gemv_kernel.FP8_DTYPE)


def fp8_gemv(
    x: torch.Tensor,  # [M, K] bf16/fp16, CUDA, 0 <= M <= GEMV_MAX_M
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
    if weight.dtype != gemv_kernel.FP8_DTYPE:
        raise ValueError(f"fp8_gemv: weight dtype {weight.dtype}, expected float8_e4m3fn")
    return gemv_kernel.gemv(x, weight, scale, bias, config=config, caller="fp8_gemv")


def tune_fp8_gemv(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,
    dtype: torch.dtype,  # the activations' dtype
) -> dict[int, triton.Config]:
    """Autotunes (and compiles and loads) the kernel for every M bucket of this weight shape,
    bias-ness and activation dtype; returns each bucket's config (gemv_kernel.tune_gemv). Eager
    only: it benchmarks with host syncs. Keys already tuned (other layers of the same shape) cost
    one launch each."""
    return gemv_kernel.tune_gemv(weight, scale, bias, dtype)
