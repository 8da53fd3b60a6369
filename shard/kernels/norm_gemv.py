"""The residual add and the RMSNorm in the prologue of the GEMV that reads the normalized row: one
launch instead of two for a decode step of a few tokens (CUDA; also under TRITON_INTERPRET=1).

Why: at batch 1 a decoder layer's input norm (elementwise.add_rms_norm) moves 8 KB yet costs
~1.7 us on an H200, a launch and a dependent round trip, before the qkv GEMV can read its
output (benchmarks/MOE_B1.md). Here every GEMV program recomputes the norm of its token's row
(a 4 KB row from L2: cheap) and multiplies it with whole weight rows:

- grid (n, cdiv(N, ROWS)): program (t, j) owns output rows j*ROWS .. j*ROWS+ROWS-1 of token t.
  Its [ROWS, H] weight slice is loaded BEFORE the PDL wait (weights are no kernel's output: that
  stream overlaps the previous kernel's tail), then the token's delta and residual rows,
  s = x + delta rounded to the model dtype and RMSNorm(s) with elementwise.add_rms_norm's
  rounding points, then its ROWS outputs (fp32 dot, rounded to the model dtype). Program (t, 0)
  stores s (the residual stream); the normalized row is not stored (only this GEMV reads it).
- Whole rows per program (ROWS x next_pow2(H) weights in registers) bound H: MAX_HIDDEN.
Plain 16-bit weights or e4m3 ones with per-row scales (--quantize fp8's), no bias (what
MergedColumnParallelLinear merges). Opt-in
(shard.layers.linear.norm_prologue): whether it beats the tuned GEMV plus the norm launch is
measured by benchmarks/moe_b1_bench.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shard.kernels import pdl
from shard.kernels.elementwise import _add_normed_row
from shard.kernels.pdl import let_dependents_launch, wait_for_predecessor

MAX_HIDDEN = 8192
MAX_TOKENS = 4  # the weight slice is re-read per token (from L2 after the first)


@dataclass(frozen=True)
class NormGemvConfig:
    rows: int  # output rows per program
    num_warps: int


def default_config(hidden: int) -> NormGemvConfig:
    """At most 8192 weight elements a program (64 fp32 registers a thread at 4 warps): 4 rows
    at H 2048, 2 at 4096, 1 at 8192."""
    block_h = triton.next_power_of_2(hidden)
    return NormGemvConfig(max(1, min(8, 8192 // block_h)), 8 if block_h >= 4096 else 4)


@triton.jit
def _add_norm_gemv_kernel(
    d_ptr,  # [n, H] delta
    x_ptr,  # [n, H] residual stream
    nw_ptr,  # [H] RMSNorm weight
    w_ptr,  # [N, H] weight (16-bit, or float8_e4m3fn with HAS_SCALE)
    s_ptr,  # [N] float32 per output row (HAS_SCALE)
    y_ptr,  # [n, N] out: RMSNorm(x + delta) @ w.T
    res_ptr,  # [n, H] out: x + delta
    N,
    H,
    stride_d,
    stride_x,
    stride_w,
    stride_y,
    eps,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_SCALE: tl.constexpr = False,
    PDL: tl.constexpr = False,
    OFFSET: tl.constexpr = 0.0,  # Llama's norm (the callers check weight_offset == 0)
):
    let_dependents_launch(PDL)
    t = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < N
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + offs_h[None, :],
                mask=rmask[:, None] & hmask[None, :], other=0.0,
                eviction_policy="evict_first")  # [ROWS, BLOCK_H], before the wait
    wait_for_predecessor(PDL)
    dt = res_ptr.dtype.element_ty
    s, h = _add_normed_row(d_ptr, x_ptr, t, stride_d, stride_x, nw_ptr, offs_h, hmask, H, eps,
                           dt, OFFSET)  # [BLOCK_H] dtype each
    if pid == 0:
        tl.store(res_ptr + t * H + offs_h, s, mask=hmask)
    # (e4m3 values are exact in fp32; the per-row scale after the dot, as the fp8 GEMV does)
    y = tl.sum(w.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)  # [ROWS]
    if HAS_SCALE:
        y = y * tl.load(s_ptr + rows, mask=rmask, other=0.0)
    tl.store(y_ptr + t * stride_y + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


def applies(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
    """Whether the fused launch serves x [n, H] against weight [N, H]: x's dtype, or e4m3 with
    per-row float32 scales [N]."""
    n, hidden = x.shape
    if scale is None:
        dtype_ok = weight.dtype == x.dtype
    else:
        dtype_ok = (weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
                    and scale.shape == (weight.shape[0],))
    return (0 < n <= MAX_TOKENS and hidden <= MAX_HIDDEN and dtype_ok and weight.dim() == 2
            and weight.shape[1] == hidden and weight.stride(1) == 1)


def add_rms_norm_linear(
    delta: torch.Tensor,  # [n, H]
    x: torch.Tensor,  # [n, H]
    norm_weight: torch.Tensor,  # [H]
    eps: float,
    weight: torch.Tensor,  # [N, H]
    config: NormGemvConfig | None = None,
    scale: torch.Tensor | None = None,  # [N] float32: weight is e4m3, row r scaled by scale[r]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + delta) @ weight.T [n, N], x + delta [n, H]) in one launch:
    elementwise.add_rms_norm, then the linear."""
    n, hidden = x.shape
    assert applies(x, weight, scale) and x.stride(1) == 1 and delta.stride(1) == 1, (n, hidden)
    cfg = config or default_config(hidden)
    out_features = weight.shape[0]
    y = torch.empty((n, out_features), dtype=x.dtype, device=x.device)
    res = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    _add_norm_gemv_kernel[(n, triton.cdiv(out_features, cfg.rows))](
        delta, x, norm_weight, weight, scale if scale is not None else norm_weight, y, res,
        out_features, hidden, delta.stride(0), x.stride(0), weight.stride(0), y.stride(0), eps,
        BLOCK_H=triton.next_power_of_2(hidden), ROWS=cfg.rows, HAS_SCALE=scale is not None,
        num_warps=cfg.num_warps,
        **pdl.launch_options(x.device),
    )
    return y, res
