"""Batched LoRA for the CUDA path: every row of a step applies its own adapter (punica-style
shrink then expand), so that requests for different adapters and the base model share one batch.

Adapters live in stacked buffers at fixed addresses (a slot per resident adapter):
    A [num_slots, R, K]  (shrink: K input features -> R, the adapter's rank padded to the slot's)
    B [num_slots, N, R]  (expand: R -> N output features, the LoRA scaling folded in)
and each row names its slot in `slots` [num_rows] (int32, -1: no adapter). The slot index is a
tensor, so a captured CUDA graph replays with whatever slots the step's rows have.

Both kernels tile the rows and, inside a tile, loop over the slots the tile's rows use (a tile
whose rows use no adapter costs one scalar test per slot): rows of the same adapter share one
tl.dot over that adapter's weights instead of each row streaming them again. The shrink splits K
over programs (decode tiles are few) and accumulates in fp32 with atomics; the expand adds the
product into the base output in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16
SHRINK_BLOCK_K = 64
SHRINK_K_PER_PROGRAM = 512  # K range of one shrink program (split-K over the grid's axis 1)
EXPAND_BLOCK_N = 64


# num_rows unspecialized: one compiled variant serves every CUDA-graph bucket (a capture cannot
# compile or load a new one).
@triton.jit(do_not_specialize=["num_rows"])
def _lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, num_rows, K, R, num_slots,
                        stride_xm, stride_as, stride_ar, stride_om, k_per_program,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    slot = tl.load(slots_ptr + rows, mask=row_ok, other=-1)
    rr = tl.arange(0, BLOCK_R)
    k_start = pid_k * k_per_program
    for s in range(0, num_slots):
        sel = slot == s
        if tl.sum(sel.to(tl.int32), axis=0) > 0:
            acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            for k0 in range(k_start, k_start + k_per_program, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < K
                x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + kk[None, :],
                            mask=sel[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
                a = tl.load(a_ptr + s * stride_as + rr[None, :] * stride_ar + kk[:, None],
                            mask=(rr[None, :] < R) & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_R]
                acc += tl.dot(x, a, input_precision=PRECISION)
            tl.atomic_add(out_ptr + rows[:, None].to(tl.int64) * stride_om + rr[None, :], acc,
                          mask=sel[:, None] & (rr[None, :] < R))


@triton.jit(do_not_specialize=["num_rows"])
def _lora_expand_kernel(s_ptr, b_ptr, slots_ptr, y_ptr, num_rows, N, R, num_slots,
                        stride_sm, stride_bs, stride_bn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                        PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    slot = tl.load(slots_ptr + rows, mask=row_ok, other=-1)
    if tl.sum((slot >= 0).to(tl.int32), axis=0) > 0:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        rr = tl.arange(0, BLOCK_R)
        r_ok = rr < R
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in range(0, num_slots):
            sel = slot == s
            if tl.sum(sel.to(tl.int32), axis=0) > 0:
                h = tl.load(s_ptr + rows[:, None].to(tl.int64) * stride_sm + rr[None, :],
                            mask=sel[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
                b = tl.load(b_ptr + s * stride_bs + cols[None, :] * stride_bn + rr[:, None],
                            mask=r_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
                acc += tl.dot(h, b.to(tl.float32), input_precision=PRECISION)
        y_at = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
        mask = (row_ok & (slot >= 0))[:, None] & col_ok[None, :]
        y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_at, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [M, K], a [num_slots, R, K], slots [M] int32 (-1: none) -> [M, R] float32 (zero rows
    for rows without an adapter)."""
    m, k = x.shape
    num_slots, r, _ = a.shape
    out = torch.zeros((m, r), dtype=torch.float32, device=x.device)
    if m == 0:
        return out
    k_per_program = min(SHRINK_K_PER_PROGRAM, triton.cdiv(k, SHRINK_BLOCK_K) * SHRINK_BLOCK_K)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(k, k_per_program))
    _lora_shrink_kernel[grid](
        x, a, slots, out, m, k, r, num_slots, x.stride(0), a.stride(0), a.stride(1),
        out.stride(0), k_per_program, BLOCK_M=BLOCK_M, BLOCK_R=max(16, triton.next_power_of_2(r)),
        BLOCK_K=SHRINK_BLOCK_K, PRECISION=_precision(x.dtype), num_warps=4,
    )
    return out


def lora_expand_(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    """y [M, N] += h [M, R] (float32) @ b[slot]^T, b [num_slots, N, R]; rows with slot -1 are
    left untouched. In place."""
    m, n = y.shape
    num_slots, _, r = b.shape
    if m == 0:
        return
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, EXPAND_BLOCK_N))
    _lora_expand_kernel[grid](
        h, b, slots, y, m, n, r, num_slots, h.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=max(16, triton.next_power_of_2(r)), BLOCK_N=EXPAND_BLOCK_N,
        PRECISION=_precision(y.dtype), num_warps=4,
    )


def _precision(dtype: torch.dtype) -> str:
    # float32 models get exact fp32 products (tf32 would drift from the torch path); 16-bit
    # operands are widened to fp32 in the expand, where "ieee" costs nothing measurable.
    return "ieee" if dtype == torch.float32 else "tf32"
