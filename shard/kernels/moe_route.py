"""Routing and expert layout of a decode step in two Triton launches (CUDA): the torch forms in
shard/kernels/moe_align.py take ~35 small kernels per MoE layer (softmax, top-k, a histogram, two
prefix sums, a sort, a scatter, a search...), which at decode batch sizes cost more than the
experts' weight streaming itself (48 layers x 35 launches of 2-3 us against a ~2 ms step).

- `route`: one program per token: softmax (float32) and the top-k by repeated arg-max, the
  family's renormalization; writes weights [n, k] float32 and ids [n, k] int32. Same math as
  moe_align.route (ties go to the lower expert id).
- `align`: ONE program for the whole step: the per-expert histogram, padded to whole blocks, its
  prefix sum, each block's expert, and every routed slot scattered to its place (an atomic
  increment of its expert's running offset: within an expert the slots' order is the order the
  atomics land, which changes nothing computed, since each row of a block is its own dot
  products; under the interpreter they land in token order, as moe_align.align_by_expert's
  stable sort puts them). Optionally adds the real rows' routed counts into a statistics row
  (shard/layers/moe.py's RoutingStats). Sequential over chunks of CHUNK slots, so it serves
  decode-sized steps (the layer uses the torch form above ALIGN_MAX_SLOTS, where a prefill's
  GEMMs dwarf it anyway).
Both keep every shape static (no host sync): CUDA-graph safe. Imported only on CUDA; both also
run under TRITON_INTERPRET=1 (tests/shard/test_triton_moe_interpreter.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard.kernels import pdl
from shard.kernels.moe_align import ExpertLayout, MoeRouting, max_padded_rows
from shard.kernels.pdl import let_dependents_launch, wait_for_predecessor
from shard.kernels.stamps import stamp
from shard.kernels.stamps import take as take_stamps

ALIGN_MAX_SLOTS = 8192  # n * k up to which `align` is used (decode and small prefills)
_CHUNK = 512  # slots per iteration of the histogram and scatter loops
_BLOCK_CHUNK = 32  # blocks per iteration of the block-expert loop ([32, bins] comparisons)


@triton.jit
def route_row(logits_ptr, t, E, stride_l, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
              SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
              SORTED: tl.constexpr):
    """Token t's routing: (weights [K_POW2] float32, ids [K_POW2] int32), entries past TOP_K
    unused. Also inlined by shard/kernels/moe_decode.py's gate/up kernel (routing fused there)."""
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + t * stride_l + offs, mask=valid, other=-float("inf")).to(tl.float32)
    return route_values(x, offs, valid, TOP_K, K_POW2, SOFTMAX_FIRST, RENORMALIZE, SORTED)


@triton.jit
def _sorted_top_k(vals, offs, K_POW2: tl.constexpr):
    """The K_POW2 largest of vals [BLOCK_E] float32 (descending; among equal values the lowest
    index first, as the max / argmax loop picks them): (values, indices). One bitonic top-k
    (tl.topk) of int64 keys, the value's bits made order-preserving in the high word and
    BLOCK_E - 1 - index in the low one, instead of K_POW2 rounds of a max and an argmax
    reduction (each a chain of cross-lane shuffles)."""
    bits = tl.where(vals == 0.0, 0.0, vals).to(tl.int32, bitcast=True)  # -0.0 as +0.0 (equal)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed order = the floats' order
    last = offs.shape[0] - 1
    keys = (ordered.to(tl.int64) << 32) | (last - offs).to(tl.int64)
    top = tl.topk(keys, K_POW2)  # [K_POW2] int64, descending
    high = (top >> 32).to(tl.int32)
    value = (high ^ ((high >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    return value, (last - (top & 0xFFFFFFFF)).to(tl.int32)


@triton.jit
def route_values(x, offs, valid, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                 SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr, SORTED: tl.constexpr):
    """route_row on a row already in registers: x [BLOCK_E] float32 logits (-inf where not
    valid), offs = arange(BLOCK_E), valid = offs < E. Also inlined by
    shard/kernels/moe_router.py (the router GEMV's last program routes its token)."""
    if SOFTMAX_FIRST:
        p = tl.exp(x - tl.max(x, 0))
        p = tl.where(valid, p, 0.0)
        vals = tl.where(valid, p / tl.sum(p, 0), -1.0)
    else:
        vals = x
    ks = tl.arange(0, K_POW2)
    # DecodeConfig.route_sorted: the same picks in the same order. A top-1 is one max / argmax
    # either way; with the sorted form a top-1 layer failed its GPU test (round 19, the device's
    # Triton 3.6; the error was not captured), so top-1 keeps the loop.
    if SORTED and K_POW2 > 1:
        top_v, top_i = _sorted_top_k(vals, offs, K_POW2)
    else:
        top_v = tl.zeros([K_POW2], dtype=tl.float32)
        top_i = tl.zeros([K_POW2], dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(vals, 0)
            idx = tl.argmax(vals, 0, tie_break_left=True)
            top_v = tl.where(ks == j, best, top_v)
            top_i = tl.where(ks == j, idx, top_i)
            vals = tl.where(offs == idx, -float("inf"), vals)
    kmask = ks < TOP_K
    if SOFTMAX_FIRST:
        if RENORMALIZE:
            top_v = top_v / tl.sum(tl.where(kmask, top_v, 0.0), 0)
    else:
        e = tl.where(kmask, tl.exp(top_v - tl.max(tl.where(kmask, top_v, -float("inf")), 0)), 0.0)
        top_v = e / tl.sum(e, 0)
    return top_v, top_i


# The routing launch's stamp points (shard/kernels/stamps.py), by stamp slot
ROUTE_STAMP_POINTS = ("start", "after the PDL wait", "stored")


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_l,
                  stamps_ptr,  # STAMPS: int64 [programs, STAMP_SLOTS] (ROUTE_STAMP_POINTS)
                  TOP_K: tl.constexpr, K_POW2: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
                  RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                  TRIGGER: tl.constexpr = False, PDL: tl.constexpr = False,
                  STAMPS: tl.constexpr = False, SORTED: tl.constexpr = False):
    # With TRIGGER it lets its programmatic dependent (the gate/up launch) be launched now, so
    # that grid's programs are placed and waiting when the routing completes. PDL: launched as a
    # programmatic dependent itself (placed during the router GEMV, waiting for its logits);
    # else a plain launch, which starts once the router GEMV has completed.
    let_dependents_launch(TRIGGER)
    stamp(stamps_ptr, tl.program_id(0), 0, STAMPS)
    wait_for_predecessor(PDL)
    stamp(stamps_ptr, tl.program_id(0), 1, STAMPS)
    t = tl.program_id(0).to(tl.int64)
    top_v, top_i = route_row(logits_ptr, t, E, stride_l, TOP_K, K_POW2, SOFTMAX_FIRST,
                             RENORMALIZE, BLOCK_E, SORTED)
    ks = tl.arange(0, K_POW2)
    kmask = ks < TOP_K
    tl.store(w_ptr + t * TOP_K + ks, top_v, mask=kmask)
    tl.store(ids_ptr + t * TOP_K + ks, top_i, mask=kmask)
    stamp(stamps_ptr, tl.program_id(0), 2, STAMPS)


def route(logits: torch.Tensor, routing: MoeRouting, num_warps: int = 4,
          trigger: bool = False, dependent: bool = False, sort: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, E] -> (weights [n, k] float32, ids [n, k] int32). trigger: the next kernel,
    if a programmatic dependent, may be launched as soon as this one starts; dependent: this
    launch is a programmatic dependent of the previous kernel (sm_90+ both; see
    moe_decode.DecodeConfig.route_trigger and route_dependent); sort: the top-k as one bitonic
    top-k of packed keys (_sorted_top_k; DecodeConfig.route_sorted), the same result."""
    n, num_experts = logits.shape
    k = routing.top_k
    weights = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, k, dtype=torch.int32, device=logits.device)
    if n:
        stamps = take_stamps("route", n, ROUTE_STAMP_POINTS)
        _route_kernel[(n,)](logits, weights, ids, num_experts, logits.stride(0),
                            stamps if stamps is not None else weights, TOP_K=k,
                            K_POW2=triton.next_power_of_2(k), SOFTMAX_FIRST=routing.softmax_first,
                            RENORMALIZE=routing.renormalize,
                            BLOCK_E=triton.next_power_of_2(num_experts), num_warps=num_warps,
                            TRIGGER=trigger and pdl.enabled(logits.device),
                            STAMPS=stamps is not None, SORTED=sort,
                            **(pdl.launch_options(logits.device) if dependent else {}))
    return weights, ids


@triton.jit(do_not_specialize=["num_slots", "max_padded", "num_blocks"])
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, offsets_ptr,
                  counts_ptr, valid_ptr, num_slots, E, max_padded, num_blocks,
                  TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BINS: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCK_CHUNK: tl.constexpr, COUNT: tl.constexpr):
    bins = tl.arange(0, BINS)
    lanes = tl.arange(0, CHUNK)
    block_lanes = tl.arange(0, BLOCK_CHUNK)
    # 1. routed slots per expert (ids outside [0, E): another rank's experts, dropped)
    hist = tl.zeros([BINS], dtype=tl.int32)
    for c0 in range(0, num_slots, CHUNK):
        offs = c0 + lanes
        e = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1).to(tl.int32)
        keep = (offs < num_slots) & (e >= 0) & (e < E)
        # slots not counted go to bin E (BINS > E), dropped below: no histogram mask, which
        # the device's Triton (3.6) may lack
        hist += tl.histogram(tl.where(keep, e, E), BINS)
        if COUNT:  # statistics: real rows only (CUDA-graph padding rows have valid 0)
            v = tl.load(valid_ptr + offs // TOP_K, mask=offs < num_slots, other=0) != 0
            counted = tl.histogram(tl.where(keep & v, e, E), BINS)
            tl.atomic_add(counts_ptr + bins, counted.to(tl.int64), mask=bins < E)
    # 2. whole blocks per expert and their prefix sum
    hist = tl.where(bins < E, hist, 0)
    padded = (hist + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)  # [BINS]
    start = end - padded
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    # 3. each block's expert: how many experts end at or before the block's first row (E for
    # the unused blocks at the end)
    for b0 in range(0, num_blocks, BLOCK_CHUNK):
        blocks = b0 + block_lanes
        first_row = blocks * BLOCK_M
        before = (end[None, :] <= first_row[:, None]) & (bins[None, :] < E)
        tl.store(block_expert_ptr + blocks, tl.sum(before.to(tl.int32), 1), mask=blocks < num_blocks)
    # 4. every row a padding row (the sentinel) first, then the routed slots at their places
    for p0 in range(0, max_padded, CHUNK):
        rows = p0 + lanes
        tl.store(sorted_ptr + rows, tl.zeros([CHUNK], dtype=tl.int32) + num_slots,
                 mask=rows < max_padded)
    tl.store(offsets_ptr + bins, start)
    tl.debug_barrier()  # the sentinel fill and the offsets land before the scatter
    for c0 in range(0, num_slots, CHUNK):
        offs = c0 + lanes
        e = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1).to(tl.int32)
        keep = (offs < num_slots) & (e >= 0) & (e < E)
        place = tl.atomic_add(offsets_ptr + tl.where(keep, e, 0), 1, mask=keep)
        tl.store(sorted_ptr + place, offs, mask=keep)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
          count_into: torch.Tensor | None = None, valid: torch.Tensor | None = None
          ) -> ExpertLayout:
    """moe_align.align_by_expert in one launch; with count_into ([E] int64), adds the routed
    slots of rows with valid[t] != 0 (all rows when valid is None) per expert."""
    slots = topk_ids.numel()
    device = topk_ids.device
    max_padded = max_padded_rows(slots, num_experts, block_m)
    max_padded = (max_padded + block_m - 1) // block_m * block_m
    num_blocks = max_padded // block_m
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    bins = triton.next_power_of_2(num_experts + 1)
    offsets = torch.empty(bins, dtype=torch.int32, device=device)
    count = count_into is not None
    if count and valid is None:  # int64 as RoutingStats' rows (one compiled variant)
        valid = torch.ones(max(slots // max(topk_ids.shape[-1], 1), 1), dtype=torch.int64,
                           device=device)
    _align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_ids, block_expert, num_padded, offsets,
        count_into if count else offsets, valid if count else offsets,
        slots, num_experts, max_padded, num_blocks,
        TOP_K=topk_ids.shape[-1], BLOCK_M=block_m, BINS=bins, CHUNK=_CHUNK,
        BLOCK_CHUNK=_BLOCK_CHUNK, COUNT=count,
        num_warps=4,
    )
    return ExpertLayout(sorted_ids, block_expert, num_padded, block_m, slots)
