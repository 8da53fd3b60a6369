"""Per-head RMSNorm of q and k in one kernel (Qwen3 / Gemma 3 style q/k norms).

Why: the torch form is ~7 launches per tensor (cast, square, mean, rsqrt, two multiplies, cast),
twice per layer, in front of the fused rotary -> KV write -> attend decode kernel; one launch
here for both tensors. Same arithmetic as shard/layers/norm.py's RMSNorm: fp32 inside, the
normalized value rounded to the model dtype, then multiplied by the weight in the model dtype.
Imported only on CUDA (triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard.kernels import pdl
from shard.kernels.pdl import let_dependents_launch, wait_for_predecessor


@triton.jit
def _norm_heads(src, w_ptr, dst, tok, st_t, st_h, n_heads, eps,
                HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                OFFSET: tl.constexpr = 0.0):
    """One token's n_heads heads [n_heads, HEAD_DIM] of src (strides st_t, st_h; unit stride in
    the head) -> dst [.., n_heads, HEAD_DIM] contiguous."""
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    cols = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    mask = (heads < n_heads) & (cols < HEAD_DIM)
    x = tl.load(src + tok * st_t + heads * st_h + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)  # [BLOCK_H]
    w = tl.load(w_ptr + cols, mask=cols < HEAD_DIM, other=0.0).to(tl.float32)
    if OFFSET != 0:  # Gemma 3: (normalized * (OFFSET + w)) in fp32, rounded once
        y = (x * rstd[:, None] * (w + OFFSET)).to(dst.dtype.element_ty)
    else:
        y = ((x * rstd[:, None]).to(dst.dtype.element_ty).to(tl.float32) * w).to(
            dst.dtype.element_ty)
    out = dst + tok * n_heads * HEAD_DIM + heads * HEAD_DIM + cols
    tl.store(out, y, mask=mask)


@triton.jit
def _qk_rms_norm_kernel(q_ptr, k_ptr, wq_ptr, wk_ptr, qo_ptr, ko_ptr, sq_t, sq_h, sk_t, sk_h,
                        n_q, n_k, eps, HEAD_DIM: tl.constexpr, BLOCK_HQ: tl.constexpr,
                        BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
                        OFFSET: tl.constexpr = 0.0):
    # Programmatic dependent launch (shard/kernels/pdl.py): launched during the qkv GEMV's tail,
    # reads q/k only after it completed; the attention kernel after it launches likewise.
    let_dependents_launch(PDL)
    wait_for_predecessor(PDL)
    tok = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _norm_heads(q_ptr, wq_ptr, qo_ptr, tok, sq_t, sq_h, n_q, eps, HEAD_DIM, BLOCK_HQ, BLOCK_D,
                    OFFSET)
    else:
        _norm_heads(k_ptr, wk_ptr, ko_ptr, tok, sk_t, sk_h, n_k, eps, HEAD_DIM, BLOCK_HK, BLOCK_D,
                    OFFSET)


def qk_rms_norm(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], unit stride in the head
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], unit stride in the head
    q_weight: torch.Tensor,  # [head_dim]
    k_weight: torch.Tensor,  # [head_dim]
    eps: float,
    weight_offset: float = 0.0,  # Gemma 3: the weight applied is (1 + w) (shard/layers/norm.py)
) -> tuple[torch.Tensor, torch.Tensor]:  # new contiguous tensors, q's and k's shapes
    n, n_q, d = q.shape
    n_k = k.shape[1]
    q_out = torch.empty((n, n_q, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((n, n_k, d), dtype=k.dtype, device=k.device)
    if n == 0:
        return q_out, k_out
    _qk_rms_norm_kernel[(n, 2)](
        q, k, q_weight, k_weight, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        n_q, n_k, eps, HEAD_DIM=d, BLOCK_HQ=triton.next_power_of_2(n_q),
        BLOCK_HK=triton.next_power_of_2(n_k), BLOCK_D=triton.next_power_of_2(d),
        OFFSET=float(weight_offset), num_warps=4, **pdl.launch_options(q.device),
    )
    return q_out, k_out
