"""Fused Triton element-wise ops for the CUDA path: RMSNorm, rotary embedding (alone or with the
KV-cache store), SiLU-and-mul and GELU(tanh)-and-mul.

Why: a decode step at small batch is a long chain of tiny kernels; the unfused torch forms cost
7 (RMSNorm), ~14 (rotary) and 2 (SiLU * up) launches per use, each a few microseconds even
inside a CUDA graph. One kernel each here, same arithmetic (fp32 inside, results rounded to the
model dtype at the same points as the torch forms). Imported only on CUDA (triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard.kernels import pdl
from shard.kernels.pdl import let_dependents_launch, wait_for_predecessor


@triton.jit
def _normed_times_weight(x, rstd, w_ptr, offs, mask, dtype, OFFSET: tl.constexpr):
    """RMSNorm's output row from fp32 x [BLOCK] and its rstd, in dtype. OFFSET == 0 (Llama):
    weight * (x * rstd).to(dtype), rounded, then multiplied in the model dtype. OFFSET != 0
    (Gemma's (1 + w)): ((x * rstd) * (OFFSET + w)) in fp32, rounded once."""
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if OFFSET != 0:
        return (x * rstd * (w + OFFSET)).to(dtype)
    y = (x * rstd).to(dtype).to(tl.float32)
    return (y * w).to(dtype)


@triton.jit
def _add_normed_row(d_ptr, x_ptr, row, stride_d, stride_x, nw_ptr, offs, mask, n_cols, eps, dtype,
                    OFFSET: tl.constexpr):
    """(s, RMSNorm(s)) [BLOCK] each in dtype of row `row` of delta and residual x, s = x + delta
    rounded to dtype: _add_rms_norm_kernel's rounding points. The fused prologues (moe_router.py,
    norm_gemv.py) compute their token's row with it."""
    d = tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    s = (x + d).to(dtype)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, 0) / n_cols + eps)
    return s, _normed_times_weight(sf, rstd, nw_ptr, offs, mask, dtype, OFFSET)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps,
                     BLOCK: tl.constexpr, PDL: tl.constexpr = False, OFFSET: tl.constexpr = 0.0):
    let_dependents_launch(PDL)  # latency-bound: the next GEMV may start streaming now
    wait_for_predecessor(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    y = _normed_times_weight(x, rstd, w_ptr, offs, mask, out_ptr.dtype.element_ty, OFFSET)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             weight_offset: float = 0.0) -> torch.Tensor:
    """x [num_tokens, hidden] -> [num_tokens, hidden] in x's dtype; weight_offset: the weight
    applied is (offset + weight), in fp32 (Gemma: 1.0)."""
    n, h = x.shape
    out = torch.empty_like(x)
    if n == 0:
        return out
    block = triton.next_power_of_2(h)
    _rms_norm_kernel[(n,)](x, weight, out, x.stride(0), out.stride(0), h, eps, BLOCK=block,
                           num_warps=8 if block >= 4096 else 4, OFFSET=float(weight_offset),
                           **pdl.launch_options(x.device))
    return out


@triton.jit
def _add_rms_norm_kernel(d_ptr, x_ptr, w_ptr, out_ptr, res_ptr, stride_d, stride_x, n_cols, eps,
                         BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                         OFFSET: tl.constexpr = 0.0, dw_ptr=None, d_eps=0.0,
                         NORM_DELTA: tl.constexpr = False):
    let_dependents_launch(PDL)  # latency-bound: the next GEMV may start streaming now
    wait_for_predecessor(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    d = tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM_DELTA:  # sandwich norms (Gemma): d = its own RMSNorm first, rounded to the dtype
        d_rstd = tl.rsqrt(tl.sum(d * d, 0) / n_cols + d_eps)
        d = _normed_times_weight(d, d_rstd, dw_ptr, offs, mask, res_ptr.dtype.element_ty,
                                 OFFSET).to(tl.float32)
    # torch form: x = x + d in the model dtype, then RMSNorm of the rounded sum
    s = (x + d).to(res_ptr.dtype.element_ty)
    tl.store(res_ptr + row * n_cols + offs, s, mask=mask)
    s = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s * s, 0) / n_cols + eps)
    y = _normed_times_weight(s, rstd, w_ptr, offs, mask, out_ptr.dtype.element_ty, OFFSET)
    tl.store(out_ptr + row * n_cols + offs, y, mask=mask)


def add_rms_norm(
    delta: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
    weight_offset: float = 0.0, delta_weight: torch.Tensor | None = None, delta_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + delta), x + delta) for [num_tokens, hidden]: the residual add fused into the
    next norm (one kernel instead of two); weight_offset as in rms_norm. delta_weight (sandwich
    norms): delta is first normalized with it (same offset) and rounded, as rms_norm would:
    (rms_norm(x + rms_norm(delta)), x + rms_norm(delta)) in one kernel instead of two."""
    n, h = x.shape
    out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    res = torch.empty((n, h), dtype=x.dtype, device=x.device)
    if n == 0:
        return out, res
    assert x.stride(1) == 1 and delta.stride(1) == 1
    block = triton.next_power_of_2(h)
    _add_rms_norm_kernel[(n,)](delta, x, weight, out, res, delta.stride(0), x.stride(0), h, eps,
                               BLOCK=block, num_warps=8 if block >= 4096 else 4,
                               OFFSET=float(weight_offset),
                               dw_ptr=weight if delta_weight is None else delta_weight,
                               d_eps=float(delta_eps), NORM_DELTA=delta_weight is not None,
                               **pdl.launch_options(x.device))
    return out, res


@triton.jit
def _rope_load(src, tok, st_t, st_h, c, s, NH: tl.constexpr, HALF: tl.constexpr,
               HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    """Token `tok`'s NH heads rotated: (first halves, second halves, [HEADS_PAD, HALF_PAD]
    offsets within a contiguous [NH, 2 * HALF] row, mask), halves fp32 [HEADS_PAD, HALF_PAD]."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    m = (offs_h < NH)[:, None] & (offs_d < HALF)[None, :]
    base = src + tok * st_t + offs_h[:, None] * st_h + offs_d[None, :]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    at = offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    return x1 * c - x2 * s, x2 * c + x1 * s, at, m


@triton.jit
def _rope_heads(src, dst, tok, st_t, st_h, c, s, NH: tl.constexpr, HALF: tl.constexpr,
                HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    first, second, at, m = _rope_load(src, tok, st_t, st_h, c, s, NH, HALF, HEADS_PAD, HALF_PAD)
    obase = dst + tok * (NH * 2 * HALF) + at
    tl.store(obase, first.to(dst.dtype.element_ty), mask=m)
    tl.store(obase + HALF, second.to(dst.dtype.element_ty), mask=m)


@triton.jit
def _rope_tables(cos_ptr, sin_ptr, pos_ptr, tok, stride_cos, dtype, HALF: tl.constexpr,
                 HALF_PAD: tl.constexpr):
    """cos, sin of token `tok`'s position, [1, HALF_PAD] fp32. Tables hold [cos(f), cos(f)]
    over head_dim; the first half is enough. Rounded to the model dtype first, as the torch form
    does."""
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    dmask = offs_d < HALF
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=dmask, other=0.0)
    s = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=dmask, other=0.0)
    return c.to(dtype).to(tl.float32)[None, :], s.to(dtype).to(tl.float32)[None, :]


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
    NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HALF: tl.constexpr, HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    c, s = _rope_tables(cos_ptr, sin_ptr, pos_ptr, tok, stride_cos, q_out_ptr.dtype.element_ty,
                        HALF, HALF_PAD)
    _rope_heads(q_ptr, q_out_ptr, tok, stride_qt, stride_qh, c, s, NUM_Q, HALF, HEADS_PAD,
                HALF_PAD)
    _rope_heads(k_ptr, k_out_ptr, tok, stride_kt, stride_kh, c, s, NUM_K, HALF, HEADS_PAD,
                HALF_PAD)


@triton.jit
def _to_cache(x, scale, dtype, cache_dtype, FP8_MAX: tl.constexpr):
    """A K or V tile (fp32, [HEADS_PAD, HALF_PAD]) as the cache stores it: rounded to the model
    dtype first (the unfused path stores the model-dtype tensor), then for fp8 caches divided
    by the per-head scale ([HEADS_PAD, 1]) and saturated."""
    x = x.to(dtype)
    if FP8_MAX > 0:
        x = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
    return x.to(cache_dtype)


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr,
    key_cache_ptr,  # [num_slots, NUM_K * 2 * HALF]
    value_cache_ptr,
    slot_ptr,  # [num_tokens] int64; negative = padding: q is rotated, nothing is stored
    k_scale_ptr,  # [NUM_K] fp32 (fp8 caches only)
    v_scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
    NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HALF: tl.constexpr, HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr = False,
):
    let_dependents_launch(PDL)
    wait_for_predecessor(PDL)
    tok = tl.program_id(0).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    c, s = _rope_tables(cos_ptr, sin_ptr, pos_ptr, tok, stride_cos, dtype, HALF, HALF_PAD)
    _rope_heads(q_ptr, q_out_ptr, tok, stride_qt, stride_qh, c, s, NUM_Q, HALF, HEADS_PAD,
                HALF_PAD)
    slot = tl.load(slot_ptr + tok)
    if slot >= 0:
        cache_dtype = key_cache_ptr.dtype.element_ty
        head = tl.arange(0, HEADS_PAD)[:, None]  # [HEADS_PAD, 1]
        ks = 1.0
        vs = 1.0
        if FP8_MAX > 0:
            ks = tl.load(k_scale_ptr + head, mask=head < NUM_K, other=1.0)
            vs = tl.load(v_scale_ptr + head, mask=head < NUM_K, other=1.0)
        row = slot * (NUM_K * 2 * HALF)
        k1, k2, at, m = _rope_load(k_ptr, tok, stride_kt, stride_kh, c, s, NUM_K, HALF,
                                   HEADS_PAD, HALF_PAD)
        tl.store(key_cache_ptr + row + at, _to_cache(k1, ks, dtype, cache_dtype, FP8_MAX),
                 mask=m)
        tl.store(key_cache_ptr + row + at + HALF,
                 _to_cache(k2, ks, dtype, cache_dtype, FP8_MAX), mask=m)
        # V is not rotated: cos 1, sin 0 loads it through the same tiles (x * 1 - y * 0 = x).
        v1, v2, _, _ = _rope_load(v_ptr, tok, stride_vt, stride_vh, 1.0, 0.0, NUM_K, HALF,
                                  HEADS_PAD, HALF_PAD)
        tl.store(value_cache_ptr + row + at, _to_cache(v1, vs, dtype, cache_dtype, FP8_MAX),
                 mask=m)
        tl.store(value_cache_ptr + row + at + HALF,
                 _to_cache(v2, vs, dtype, cache_dtype, FP8_MAX), mask=m)


def rotary(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [max_positions, head_dim] fp32
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX rotate-half rotary embedding of q and k; new contiguous tensors."""
    n, hq, d = q.shape
    hk = k.shape[1]
    q_out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((n, hk, d), dtype=k.dtype, device=k.device)
    if n == 0:
        return q_out, k_out
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1
    half = d // 2
    _rotary_kernel[(n,)](
        q, k, cos, sin, positions, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        NUM_Q=hq, NUM_K=hk, HALF=half, HEADS_PAD=triton.next_power_of_2(max(hq, hk)),
        HALF_PAD=triton.next_power_of_2(half), num_warps=4,
    )
    return q_out, k_out


def rotary_store_kv(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [max_positions, head_dim] fp32
    sin: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 for padding tokens
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32, fp8 caches only
    v_scale: torch.Tensor | None = None,
    fp8_max: float = 0.0,  # > 0: the cache is fp8 with this saturation bound
) -> torch.Tensor:
    """`rotary` and the KV-cache store in one kernel (one launch instead of two per layer):
    returns the rotated q [num_tokens, num_heads, head_dim]; rotated k and v go straight into
    their cache slots, with the same values the two unfused kernels store."""
    n, hq, d = q.shape
    hk = k.shape[1]
    q_out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return q_out
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and cos.stride(1) == 1
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    half = d // 2
    _rotary_store_kv_kernel[(n,)](
        q, k, v, cos, sin, positions, q_out, key_cache, value_cache, slot_mapping,
        slot_mapping if k_scale is None else k_scale,  # never read for model-dtype caches
        slot_mapping if v_scale is None else v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0),
        NUM_Q=hq, NUM_K=hk, HALF=half, HEADS_PAD=triton.next_power_of_2(max(hq, hk)),
        HALF_PAD=triton.next_power_of_2(half), FP8_MAX=fp8_max, num_warps=4,
        **pdl.launch_options(q.device),
    )
    return q_out


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, stride_g, stride_u, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    # torch form: silu(g) rounded to the dtype, then * u in the dtype
    a = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + offs, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_tanh_mul_kernel(g_ptr, u_ptr, out_ptr, stride_g, stride_u, n_cols,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    # torch form: F.gelu(g, approximate="tanh") rounded to the dtype, then * u in the dtype;
    # gelu = 0.5 g (1 + tanh(z)), z = sqrt(2/pi) (g + 0.044715 g^3); 1 + tanh(z) = 2 / (1 + e^-2z)
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    a = g / (1.0 + tl.exp(-2.0 * z))
    a = a.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + offs, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's gated MLP) for [num_tokens, inter] tensors (row stride may
    differ, columns contiguous)."""
    n, cols = gate.shape
    out = torch.empty((n, cols), dtype=gate.dtype, device=gate.device)
    if n == 0:
        return out
    block = 1024
    _gelu_tanh_mul_kernel[(n, triton.cdiv(cols, block))](
        gate, up, out, gate.stride(0), up.stride(0), cols, BLOCK=block, num_warps=4)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [num_tokens, inter] tensors (row stride may differ, columns contiguous)."""
    n, cols = gate.shape
    out = torch.empty((n, cols), dtype=gate.dtype, device=gate.device)
    if n == 0:
        return out
    block = 1024
    _silu_mul_kernel[(n, triton.cdiv(cols, block))](
        gate, up, out, gate.stride(0), up.stride(0), cols, BLOCK=block, num_warps=4)
    return out
