"""Fused mixture-of-experts MLP (CUDA, Triton): two grouped-GEMM launches for all experts.

    x [n, H], topk (weights, ids) [n, k]
      -> align_by_expert (shard/kernels/moe_align.py): the n * k routed slots grouped by expert in
         blocks of BLOCK_M rows (torch ops, no host sync, shapes fixed by n)
      -> launch 1: per (block, BLOCK_N columns) program, rows x[slot // k] times the block's
         expert's gate and up rows, silu(gate) * up in the epilogue -> inter [n * k, I]
      -> launch 2: inter rows times the expert's down rows, times the slot's routing weight
         -> out [n * k, H]
      -> sum over each token's k slots -> [n, H]

Decode-sized steps (a few routed slots) take shard/kernels/moe_decode.py instead (FusedMoE
chooses by n * k): at batch 1 these padded 16-row tiles and the launches around them are
latency-bound.

Why: the naive form runs every expert's MLP as its own small matmuls after a host-side nonzero()
per expert (a sync each, no CUDA graph); here a decode step is 2 launches plus a handful of tiny
torch ops, and each expert's weights are streamed once per step however many of the step's
tokens chose it (its rows share the block). Prefill blocks of 64 rows run on tensor cores like
any GEMM.

Weights: w13 [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up) and w2 [E, H, I], bf16/fp16, or
float8_e4m3fn with one fp32 scale per expert and output channel (scale13 [E, 2I], scale2 [E, H]):
weight-only fp8, converted to the activation dtype in registers (e4m3 values are exact in
bf16/fp16), the scale applied once per output in the epilogue. A decode step reads half the
bytes.

CUDA graphs: a launch allocates only its outputs and never syncs; the grid covers the layout's
static block count and programs past the used blocks (a device value) return at once. Triton
compiles a variant per config (BLOCK_* constexprs) and argument specialization at the first
launch, which a capturing stream forbids: `warm_up` launches every config of the table once
eagerly (the layer calls it at its first eager CUDA forward); `num_slots` and `num_blocks` are not specialized, so
batch size changes reuse the compiled variants.

Imported only on CUDA (Triton is not a CPU dependency); the kernel also runs under
TRITON_INTERPRET=1 on CPU tensors (tests/shard/test_triton_moe_interpreter.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shard.kernels.moe_align import ExpertLayout, align_by_expert


@dataclass(frozen=True)
class MoeConfig:
    """Tiling of both launches. block_m is also the layout's block size."""

    block_m: int
    block_n: int  # launch 1: intermediate columns (gate and up tiles each); launch 2: hidden
    block_k: int
    num_warps: int
    num_stages: int


# By average routed rows per expert (n * k / E): decode-sized steps stream weights with 16-row
# blocks (the MMA's smallest tile) and narrow column tiles (many programs in flight per expert);
# prefill-sized ones take 64-row GEMM tiles. benchmarks/moe_bench.py sweeps alternatives.
CONFIGS: tuple[tuple[float, MoeConfig], ...] = (
    (4.0, MoeConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)),
    (96.0, MoeConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4)),
    (float("inf"), MoeConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)),
)


def config_for(num_slots: int, num_experts: int) -> MoeConfig:
    """The table's config for n * k = num_slots routed rows over num_experts experts."""
    per_expert = num_slots / num_experts
    return next(cfg for limit, cfg in CONFIGS if per_expert <= limit)


@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def _moe_gemm_kernel(
    a_ptr,  # [rows, K]: x [n, H] (launch 1, row = slot // A_DIV) or inter [n * k, I] (launch 2)
    b_ptr,  # [E, N_B, K] expert weights
    c_ptr,  # [n * k, N] output, row = slot
    scale_ptr,  # [E, N_B] fp32 per-channel scales (HAS_SCALE)
    weight_ptr,  # [n * k] fp32 routing weights (MUL_WEIGHT)
    sorted_ptr,  # [max_padded] int32 slots grouped by expert
    block_expert_ptr,  # [max_blocks] int32
    num_padded_ptr,  # [1] int32
    N,  # output columns (launch 1: I, reading gate rows [0, I) and up rows [I, 2I))
    K,
    num_slots,  # n * k: the sentinel of padding rows
    num_blocks,  # max_blocks (grid axis of rows)
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_se,
    A_DIV: tl.constexpr,  # top_k (launch 1) or 1 (launch 2)
    SILU_MUL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for float32 activations (the exact CPU-parity path)
):
    pid = tl.program_id(0)
    # Row blocks fastest: consecutive programs read the same column tile of (mostly) the same
    # expert, which L2 then serves to the expert's other row blocks.
    pid_m = pid % num_blocks
    pid_n = pid // num_blocks
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + offs_m)  # [BLOCK_M]
    row_mask = slots < num_slots
    a_rows = (slots // A_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    # [BLOCK_K, BLOCK_N]: the expert's weight rows offs_n, transposed (K contiguous)
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    up_off = N * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
        if SILU_MUL:
            bu = tl.load(b_ptrs + up_off, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up = tl.dot(a, bu.to(a.dtype), acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    out_ty = c_ptr.dtype.element_ty
    if HAS_SCALE:
        s_ptrs = scale_ptr + expert * stride_se + offs_n
        acc = acc * tl.load(s_ptrs, mask=n_mask, other=0.0)[None, :]
        if SILU_MUL:
            acc_up = acc_up * tl.load(s_ptrs + N, mask=n_mask, other=0.0)[None, :]
    y = acc
    if SILU_MUL:
        # Roundings as the torch form: gate and up in the model dtype, silu(gate) rounded, the
        # product rounded at the store.
        g = acc.to(out_ty).to(tl.float32)
        u = acc_up.to(out_ty).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32) * u
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + slots, mask=row_mask, other=0.0)
        y = y.to(out_ty).to(tl.float32) * w[:, None]
    c_ptrs = c_ptr + slots[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, y.to(out_ty), mask=row_mask[:, None] & n_mask[None, :])


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, scale: torch.Tensor | None,
            weights: torch.Tensor | None, layout: ExpertLayout, a_div: int, silu_mul: bool,
            cfg: MoeConfig) -> None:
    n_out, k_dim = c.shape[1], b.shape[2]
    num_blocks = layout.block_expert.numel()
    grid = (num_blocks * triton.cdiv(n_out, cfg.block_n),)
    _moe_gemm_kernel[grid](
        a, b, c,
        scale if scale is not None else c,  # unused pointer without HAS_SCALE
        weights if weights is not None else c,
        layout.sorted_ids, layout.block_expert, layout.num_padded,
        n_out, k_dim, layout.num_slots, num_blocks,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        scale.stride(0) if scale is not None else 0,
        A_DIV=a_div, SILU_MUL=silu_mul, HAS_SCALE=scale is not None,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def fused_moe(
    x: torch.Tensor,  # [n, H] bf16/fp16 (fp32 under the interpreter)
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [n, k] float32
    topk_ids: torch.Tensor,  # [n, k] int; ids >= E (another rank's experts) contribute nothing
    scale13: torch.Tensor | None = None,  # [E, 2I] float32 with fp8 weights
    scale2: torch.Tensor | None = None,  # [E, H] float32 with fp8 weights
    config: MoeConfig | None = None,
    layout: ExpertLayout | None = None,
    all_local: bool = False,
) -> torch.Tensor:
    """sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j] -> [n, H] x.dtype.
    layout: the routed slots already aligned in blocks of config.block_m rows (e.g. by
    shard/kernels/moe_route.align); else align_by_expert's torch form builds it.
    all_local: every id is below E (tensor parallelism: every rank holds every expert), so
    every slot's output row is written and needs no zeroing (one kernel less)."""
    n, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, inter2, _ = w13.shape
    cfg = config or config_for(n * top_k, num_experts)
    if layout is None:
        layout = align_by_expert(topk_ids, num_experts, cfg.block_m)
    assert layout.block_m == cfg.block_m
    x = x.contiguous()
    inter = torch.empty(n * top_k, inter2 // 2, dtype=x.dtype, device=x.device)
    _launch(x, w13, inter, scale13, None, layout, top_k, True, cfg)
    # Zeros unless all_local: a slot whose expert this rank does not hold is written by
    # neither launch.
    alloc = torch.empty if all_local else torch.zeros
    out = alloc(n * top_k, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _launch(inter, w2, out, scale2, weights, layout, 1, False, cfg)
    return out.view(n, top_k, hidden).sum(dim=1)


def warm_up(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
            scale13: torch.Tensor | None, scale2: torch.Tensor | None) -> None:
    """Compiles and loads every config of the table for these weights and top_k (eagerly, before
    any CUDA-graph capture); x [*, H] only gives the dtype and device."""
    num_experts = w13.shape[0]
    ids = torch.arange(top_k, device=x.device)[None, :] % num_experts  # [1, k]
    weights = torch.ones(1, top_k, dtype=torch.float32, device=x.device)
    one = torch.zeros(1, x.shape[-1], dtype=x.dtype, device=x.device)
    for _, cfg in CONFIGS:
        fused_moe(one, w13, w2, weights, ids, scale13, scale2, cfg)
