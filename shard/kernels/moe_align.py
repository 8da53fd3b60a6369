"""Mixture-of-experts routing and the token layout of the grouped GEMMs (torch only: these run on
CPU and CUDA alike, and inside CUDA graphs).

The grouped GEMM (shard/kernels/fused_moe.py, or `grouped_moe_torch` below on CPU) reads its
rows in blocks of `block_m` rows that all belong to one expert. `align_by_expert` builds that
layout from the router's choices without any host sync and with shapes that depend only on the
number of tokens (never on how they were routed), so a captured decode graph replays it:

    topk_ids [n, k]  ->  sorted_ids [max_padded]   flat slots t * k + j, grouped by expert, each
                                                   expert's group padded to a multiple of block_m
                                                   with the sentinel n * k (rows read as zero,
                                                   written nowhere)
                         block_expert [max_blocks] the expert of each block of block_m rows, or
                                                   num_experts for the unused blocks at the end
                         num_padded [1]            the used length of sorted_ids (device tensor)

max_padded bounds the used length for ANY routing of n tokens: every non-empty expert adds at
most block_m - 1 padding rows, and at most min(num_experts, n * k) experts are non-empty.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoeRouting:
    """How a family turns router logits into each token's experts and weights.

    softmax_first: softmax over all experts, then the top-k of the probabilities (Mixtral, Qwen);
      False: the top-k of the logits, then a softmax over those k only.
    renormalize: the k chosen weights are divided by their sum (Mixtral; Qwen's norm_topk_prob).
      A softmax over the chosen k is already normalized, so this matters with softmax_first only.
    """

    top_k: int
    renormalize: bool
    softmax_first: bool = True


def route(logits: torch.Tensor, routing: MoeRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, E] -> (weights [n, k] float32, ids [n, k] int64), as transformers computes them
    (softmax in float32, top-k by value)."""
    if routing.softmax_first:
        probs = torch.softmax(logits.float(), dim=-1)  # [n, E]
        weights, ids = torch.topk(probs, routing.top_k, dim=-1)  # [n, k]
        if routing.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    top, ids = torch.topk(logits.float(), routing.top_k, dim=-1)
    return torch.softmax(top, dim=-1), ids


def max_padded_rows(num_slots: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the aligned layout's used rows for num_slots = n * k routed slots."""
    return num_slots + min(num_experts, num_slots) * (block_m - 1)


@dataclass(frozen=True)
class ExpertLayout:
    """Routed slots grouped by expert in blocks of block_m rows (see module docstring)."""

    sorted_ids: torch.Tensor  # [max_padded] int32, flat slot t * k + j or the sentinel n * k
    block_expert: torch.Tensor  # [max_padded // block_m] int32, num_experts for unused blocks
    num_padded: torch.Tensor  # [1] int32, used rows of sorted_ids
    block_m: int
    num_slots: int  # n * k (the sentinel)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertLayout:
    """topk_ids [n, k] (int, ids in [0, num_experts); ids >= num_experts, e.g. experts another
    rank owns, are dropped) -> the block-aligned layout. No host sync, shapes fixed by n."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)  # [n * k]
    slots = flat.numel()
    max_padded = max_padded_rows(slots, num_experts, block_m)
    max_padded = (max_padded + block_m - 1) // block_m * block_m
    # Per expert: routed slots, and the same padded up to whole blocks. scatter_add_, not
    # bincount: bincount's output size depends on the data (a host sync on CUDA).
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat.clamp(max=num_experts), torch.ones_like(flat))
    counts = counts[:num_experts]  # [E]; slots routed past the local experts are dropped
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    # Slots sorted by expert (stable: by token within an expert), then each placed at its
    # expert's padded start + its rank within the expert.
    order = torch.argsort(flat, stable=True)  # [n * k]
    expert_sorted = flat[order]
    keep = expert_sorted < num_experts
    e = expert_sorted.clamp(max=num_experts - 1)
    rank = torch.arange(slots, device=device) - count_start[e]
    dest = torch.where(keep, padded_start[e] + rank, max_padded)  # dropped slots: past the end
    sorted_ids = torch.full((max_padded + 1,), slots, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = sorted_ids[:max_padded]
    # The expert of each block: the first expert whose padded range ends past the block start.
    block_start = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    num_padded = padded_end[-1:].to(torch.int32)
    return ExpertLayout(sorted_ids, block_expert, num_padded, block_m, slots)


def grouped_moe_torch(
    x: torch.Tensor,  # [n, H]
    w13: torch.Tensor,  # [E, 2I, H]: rows 0..I-1 gate, I..2I-1 up
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [n, k] float32
    layout: ExpertLayout,
    top_k: int,
    scale13: torch.Tensor | None = None,  # [E, 2I] float32 with fp8 weights
    scale2: torch.Tensor | None = None,  # [E, H] float32 with fp8 weights
) -> torch.Tensor:
    """The fused layer's math in torch on the aligned layout (the CPU path; the Triton kernel
    computes the same per block): rows gathered by the layout (padding rows zero), each run of
    one expert's blocks through its gate/up -> silu(gate) * up -> down (one matmul pair per
    expert, its weights dequantized one expert at a time), times the routing weight, summed over
    each token's k slots. Returns [n, H] in x's dtype."""
    n, hidden = x.shape
    slots = layout.num_slots
    used = int(layout.num_padded.item())  # CPU path: a host read is free
    bm = layout.block_m
    ids = layout.sorted_ids[:used].long()  # [used]
    valid = ids < slots
    token = torch.where(valid, ids // top_k, 0)
    a = x[token] * valid[:, None].to(x.dtype)  # [used, H]
    y = torch.zeros(used, hidden, dtype=x.dtype, device=x.device)
    row = 0
    for e, run in itertools.groupby(layout.block_expert[: used // bm].tolist()):
        rows = slice(row, row + bm * len(list(run)))
        row = rows.stop
        g13, g2 = w13[e].to(x.dtype), w2[e].to(x.dtype)  # [2I, H], [H, I]
        if scale13 is not None and scale2 is not None:
            g13 = g13 * scale13[e][:, None].to(x.dtype)
            g2 = g2 * scale2[e][:, None].to(x.dtype)
        gate, up = (a[rows] @ g13.t()).chunk(2, dim=-1)
        y[rows] = (torch.nn.functional.silu(gate) * up) @ g2.t()
    w = topk_weights.reshape(-1)[torch.where(valid, ids, 0)] * valid  # [used] float32
    out = torch.zeros(slots + 1, hidden, dtype=torch.float32, device=x.device)
    out.index_add_(0, torch.where(valid, ids, slots), y.float() * w[:, None])
    return out[:slots].view(n, top_k, hidden).sum(dim=1).to(x.dtype)


def per_expert_loop(
    x: torch.Tensor,  # [n, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [n, k]
    topk_ids: torch.Tensor,  # [n, k]
) -> torch.Tensor:
    """The naive form (what transformers' experts do): for each expert, find its tokens (a host
    sync), run its MLP on them, add the weighted output. The tests' reference and the GPU
    benchmark's baseline. -> [n, H] in x's dtype."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        tok, j = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        gate, up = (x[tok] @ w13[e].t()).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ w2[e].t()  # [t, H]
        out.index_add_(0, tok, y.float() * topk_weights[tok, j, None].float())
    return out.to(x.dtype)
