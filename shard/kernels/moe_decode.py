"""Decode-sized mixture-of-experts MLP (CUDA, Triton): two weight-streaming launches, no layout.

For a handful of routed slots (n * k up to ~32: batch 1-4 at top-8) the grouped GEMM of
shard/kernels/fused_moe.py is latency-bound: each expert's rows are padded to a 16-row MMA tile,
the step needs the routing, layout and sum kernels around its two GEMMs, and few programs per
expert stream its weights. At batch 1 the step reads k experts' weights (Qwen3-30B-A3B: 8 x 9.4
MB bf16) and nothing else, so it is a GEMV's problem: keep every SM streaming weight bytes.

    launch 1, grid (n * k slots, I tiles) (config.slots_first; else transposed): the slot's
      token row x[t] against its expert's gate and up rows (CUDA-core FMAs, fp32 accumulation,
      wide K loads, as shard/kernels/gemv.py's batch-1 path), silu(gate) * up -> inter
      [n * k, I]. With `logits` the routing itself (softmax, top-k, renormalization:
      moe_route.route_row) runs in each program (128 logits: free) and the N-tile-0 programs
      write the slot's weight and id (and the routing statistics): no routing launch.
      Or (config.up_stream, given routing only) persistent: grid (min(items, up_stream x SMs)),
      the items (held slot, I tile) strided over the programs, each program's items and their
      K tiles ONE flattened, software-pipelined stream (the epilogue at each item's last K
      tile): one pipeline ramp a program instead of one a (slot, I tile), and a tail of one
      item (at batch 1 the gridded form's 768 programs each stream 8 K tiles of 16 x 256).
    launch 2, grid (n tokens, H tiles): for each output column tile, the sum over the token's k
      slots of w_j * down_{e_j}(inter[t, j]) in fp32 registers -> out [n, H]: the weighted sum
      over the k slots is fused (no [n * k, H] buffer, no sum kernel, no atomics, no zeroing).
      The k slots' down rows are one flattened, software-pipelined stream of K tiles.
      Or (config.down_split: the fp8 table's batch-1 entry) grid (n * k slots, H / down_split row
      blocks): each program streams one slot's [down_split, I] slice (its expert id, a guess,
      and first K tile loaded before the PDL wait), writes an fp32 partial row [n * k, H], and
      the last program of a (token, row block) by an acq_rel ticket sums the k partials in slot
      order with the routing weights: 8x the programs at batch 1, no serial 8-experts x K-tiles
      chain.

fp8 weights (float8_e4m3fn, per expert and output channel fp32 scales) are loaded as 1 byte and
converted in registers: a step reads half the bytes. Slots whose id is outside [0, E) (another
rank's experts) read nothing and add zero.

Rounding: gate and up are rounded to the activations' dtype, silu(gate) and the product too (as
the torch form); each slot's down output is scaled by its routing weight and summed in fp32,
rounded once (the grouped path rounds each slot's weighted row before its sum). The split down
launch keeps those points (fp32 partials, weights applied in slot order, one rounding); its K
sum runs in another fp32 order (the output may differ by one rounding step of its dtype).

Programmatic dependent launch (shard/kernels/pdl.py, sm_90+): both launches are dependents, so
each one's programs are dispatched during the previous kernel's tail (everything they read is an
earlier kernel's output, so they wait before their first load).

CUDA graphs: a launch allocates only its outputs and never syncs; the grid depends on n only.
Triton compiles a variant per config and flags at the first launch (forbidden while capturing):
`warm_up` launches every config of the table eagerly (FusedMoE does at its first eager forward).

Imported only on CUDA (Triton is not a CPU dependency); the kernels also run under
TRITON_INTERPRET=1 on CPU tensors (tests/shard/test_triton_moe_interpreter.py).
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shard.kernels import pdl
from shard.kernels.moe_align import MoeRouting
from shard.kernels.moe_route import route_row
from shard.kernels.pdl import let_dependents_launch, wait_for_predecessor
from shard.kernels.setting import Setting
from shard.kernels.stamps import program_index, stamp
from shard.kernels.stamps import take as take_stamps
from shard.kernels.tickets import TicketCounters


@dataclass(frozen=True)
class DecodeConfig:
    """Tiling of the two decode launches."""

    up_block_n: int  # weight rows per gate/up program: up_block_n / 2 gate rows + as many up rows
    up_block_k: int
    up_warps: int
    down_block_n: int  # output columns per down program
    down_block_k: int
    down_warps: int
    stages: int  # software pipelining depth of both K loops (1: plain register loads)
    # The layer's routing (softmax, top-k) inside every gate/up program (no routing launch, but
    # each program's weight stream starts after it) or as moe_route.route's launch before.
    route_inside: bool = True
    # Warps of that routing launch (route_inside False): one keeps the softmax and the top-k's
    # arg-max reductions inside a warp (shuffles; 0 CTA barriers in its sm_90 PTX against 43
    # with 4 warps). The Qwen3-30B-A3B batch-1 step on an H200, interleaved with 4 warps
    # (benchmarks/MOE_B1.md, round 16): 1.5-1.6 us a layer less, bf16 and fp8.
    route_warps: int = 1
    # That routing launch lets the gate/up launch (a programmatic dependent) be launched as it
    # starts: gate/up's programs are then placed during the routing and wait for it, instead of
    # being launched and placed once it has completed.
    route_trigger: bool = False
    # That routing launch is itself a programmatic dependent of the router GEMV (placed during
    # it, waiting for its logits) instead of a plain launch.
    route_dependent: bool = False
    # That routing launch picks its top-k with one bitonic top-k of packed (value, index) keys
    # instead of top_k rounds of a max and an argmax reduction (moe_route._sorted_top_k; the
    # same picks in the same order; 83 warp shuffles against 133 in its sm_90 PTX). Qwen3-30B-
    # A3B batch-1 step on an H200 without the profiler (benchmarks/MOE_B1.md, round 19), twice
    # each, interleaved: bf16 2.711 / 2.703 ms against 2.714-2.723, fp8 1.964 / 1.963 against
    # 1.984-2.002.
    route_sorted: bool = True
    # The fused-sum down launch (down_split 0) loads the slots' expert ids before its PDL wait,
    # a guess checked after it (a stale guess streams again): its weight stream starts one L2
    # round trip earlier. Pays where the ids are final by then (the routing launch completed
    # before gate/up started: no route_trigger, no route_inside).
    down_early_ids: bool = False
    # The gridded gate/up launch lets the down launch go only after its PDL wait (the routing
    # has completed) instead of as it starts: with route_trigger its programs are placed during
    # the routing, and down's would otherwise be placed then too (bf16's fused-sum down launch
    # placed that early ran 27 instead of 10.7 us a layer, round 17).
    up_late_trigger: bool = False
    # Grid order: routed slots (tokens, for down) fastest, so slots sharing an expert stream its
    # rows together; False: column tiles fastest.
    slots_first: bool = True
    # The split down launch (0: off): grid (n * k slots, H / down_split rows): each program
    # streams ONE slot's expert slice [down_split, I] (K tiles of down_block_k) and writes its
    # fp32 partial row; the last program of a (token, row block), by an acq_rel ticket, sums the
    # k partials in slot order with the routing weights and writes the output. At batch 1 that
    # is 8 x H / down_split programs (512 at 32 rows) instead of H / down_block_n looping over 8
    # experts x K tiles: more bytes in flight, no serial 8-experts x K-tiles chain. Its expert
    # id (a guess) and first K tile are loaded before the PDL wait and checked after it.
    down_split: int = 0
    down_stages: int = 0  # the down launch's pipelining depth (0: `stages`)
    # The persistent gate/up launch (0: off, the gridded one): m > 0 is m programs per SM
    # (int_gemv_wide's `persist`), at most one per work item (held slot, row tile of up_block_n
    # rows). Each program runs its items' K tiles (up_block_k wide, `stages` deep) as one
    # pipelined stream: one ramp a program, not one a (slot, row tile). Given routing only
    # (route_inside=False): the ids are the routing launch's output.
    up_stream: int = 0

    def __post_init__(self) -> None:
        if self.up_stream < 0 or (self.up_stream and self.route_inside):
            raise ValueError(f"DecodeConfig: up_stream={self.up_stream} needs programs per SM "
                             f">= 0 and route_inside=False")

    def name(self) -> str:
        """'up16x256w4-down8x256w4-st4[-dst3-split32][-upstream1]' (benchmarks' rows;
        upstream<m>: the persistent gate/up launch, m programs per SM)."""
        return (f"up{self.up_block_n}x{self.up_block_k}w{self.up_warps}-down"
                f"{self.down_split or self.down_block_n}x{self.down_block_k}w{self.down_warps}"
                f"-st{self.stages}"
                + (f"-dst{self.down_stages}" if self.down_stages else "")
                + (f"-split{self.down_split}" if self.down_split else "")
                + (f"-upstream{self.up_stream}" if self.up_stream else "")
                + (f"-routew{self.route_warps}" if self.route_warps != 1 else "")
                + ("-route-trigger" if self.route_trigger else "")
                + ("-route-dependent" if self.route_dependent else "")
                + ("" if self.route_sorted else "-route-loop")
                + ("-up-late-trigger" if self.up_late_trigger else "")
                + ("-down-early-ids" if self.down_early_ids else "")
                + ("-route-inside" if self.route_inside else "")
                + ("" if self.slots_first else "-cols-first"))


# By routed slots n * k, for 16-bit and for fp8 weights (1-byte loads: twice the K per tile for
# the same bytes in flight): the decode kernels up to the last limit, the grouped GEMM past it
# (FusedMoE). benchmarks/moe_bench.py's layer part sweeps alternatives and times both paths per
# batch (the crossover).
DECODE_CONFIGS: dict[bool, tuple[tuple[int, DecodeConfig], ...]] = {
    # H200 sweep (benchmarks/raw/round11/moe/): routing as its own launch beats routing inside
    # every program at each batch (bf16 batch 1: 29.0 vs 45.1 us a layer; with programmatic
    # dependent launch the in-kernel routing delays every program's weight stream), and 8 output
    # columns per down program beat 4.
    # Round 17 (H200, interleaved A/B, benchmarks/MOE_B1.md): the down launch's ids before its
    # wait: its exposed time 10.7 -> 9.8 us a layer. route_trigger is NOT for bf16's fused-sum
    # down launch: placed during the routing it ran 27.0 instead of 10.7 us a layer.
    False: ((32, DecodeConfig(16, 256, 4, 8, 256, 4, 4, route_inside=False,
                              down_early_ids=True)),),
    # fp8 at batch 1 (8 slots): the split down launch, 32 rows a program, measured on an H100
    # (2026-11-28, Qwen3-30B-A3B shape, benchmarks/MOE_B1.md round 15): down + sum alone 18.9 ->
    # 7.5 us a layer; the whole CUDA-graph step 2.977 -> 2.586 ms against the 32-slot entry in
    # the same process. bf16 keeps the fused sum (its split form measured +1.8 us a layer in
    # the step). Batches of 2-4 (9-32 slots) keep the entry they were measured with.
    # Round 17 (H200, interleaved A/B): the routing launch lets gate/up launch as it starts
    # (route_trigger): gate/up's exposed time 11.2 -> 9.5 us a layer, the step -1.1 us a layer
    # (the split down launch checks its guessed ids, so an early placement is safe).
    True: ((8, DecodeConfig(16, 512, 4, 8, 256, 4, 4, route_inside=False, down_split=32,
                            down_stages=3, route_trigger=True)),
           (32, DecodeConfig(16, 512, 4, 8, 512, 4, 4, route_inside=False))),
}
DECODE_MAX_SLOTS = 32


# benchmarks' A/B switch (config_override): None uses the table.
_OVERRIDE: Setting[DecodeConfig | None] = Setting(None)


def config_override(config: DecodeConfig | None) -> AbstractContextManager[None]:
    """Decode-sized launches inside the block use `config` instead of the table's (None: the
    table): benchmarks compare configs in one process (shard/kernels/setting.py)."""
    return _OVERRIDE.override(config)


def decode_config_for(num_slots: int, fp8: bool = False) -> DecodeConfig | None:
    """The table's decode config for n * k routed slots (or the override), or None past
    DECODE_MAX_SLOTS."""
    if num_slots > DECODE_MAX_SLOTS:
        return None
    if _OVERRIDE.value is not None:
        return _OVERRIDE.value
    return next((cfg for limit, cfg in DECODE_CONFIGS[fp8] if num_slots <= limit),
                DECODE_CONFIGS[fp8][-1][1])


@triton.jit
def _tile_rows(tile, I, BLOCK_N: tl.constexpr):
    """Row tile `tile` of an expert's w13 [2I, H]: tile row 2r is gate row c_r, 2r + 1 up row
    I + c_r, c_r = tile * BLOCK_N / 2 + r (the bytes in flight of one tile serve both halves of
    the epilogue). -> rows [BLOCK_N] int32, row_mask [BLOCK_N] (c_r < I)."""
    r = tl.arange(0, BLOCK_N)
    cols = tile * (BLOCK_N // 2) + r // 2
    return cols + (r % 2) * I, cols < I


@triton.jit
def _tile_dots(w_rows, row_mask, x_row, k, H):
    """One K tile of the gate/up dot products: w_rows [BLOCK_N] row pointers, x_row the token's
    activations, k [BLOCK_K] columns (those >= H read nothing). -> [BLOCK_N] fp32 partial dots."""
    k_mask = k < H
    w = tl.load(w_rows[:, None] + k[None, :], mask=row_mask[:, None] & k_mask[None, :],
                other=0.0, eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K], read once
    xv = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
    return tl.sum(w.to(tl.float32) * xv[None, :], axis=1)


@triton.jit
def _silu_mul_store(acc, rows, row_mask, s_row, inter_row, tile, I, HAS_SCALE: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """The gate/up epilogue of one row tile: acc [BLOCK_N] fp32 dots in _tile_rows' interleaved
    order (times the fp8 scales s_row[rows] when HAS_SCALE) -> inter_row[c] = silu(gate_c) *
    up_c for the tile's BLOCK_N / 2 columns c < I. Rounded to inter's dtype at the torch form's
    points: gate and up, silu(gate), the product."""
    out_ty = inter_row.dtype.element_ty
    if HAS_SCALE:
        acc = acc * tl.load(s_row + rows, mask=row_mask, other=0.0)
    y = acc.to(out_ty).to(tl.float32)
    g, u = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))  # [BLOCK_N // 2] each
    a = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
    offs_out = tile * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(inter_row + offs_out, (a * u).to(out_ty), mask=offs_out < I)


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [n, H] activations
    w_ptr,  # [E, 2I, H] rows 0..I-1 gate, I..2I-1 up
    s_ptr,  # [E, 2I] fp32 scales (HAS_SCALE)
    inter_ptr,  # [n * k, I] out: silu(gate) * up per slot
    logits_ptr,  # [n, E] router logits (ROUTE)
    topw_ptr,  # [n * k] fp32 routing weights: written when ROUTE
    ids_ptr,  # [n * k] expert ids: read, or written (int32) when ROUTE
    counts_ptr,  # [E] int64 routing statistics (COUNT)
    valid_ptr,  # [n] int64, 1 for real rows (COUNT)
    I,
    H,
    E,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_l,
    stamps_ptr,  # STAMPS: int64 [programs, STAMP_SLOTS] (GATE_UP_STAMP_POINTS)
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    ROUTE: tl.constexpr,
    SOFTMAX_FIRST: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    COUNT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    SLOTS_FIRST: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a programmatic dependent (shard/kernels/pdl.py)
    # PDL: let the down launch go at once (TRIGGER_FIRST) or after the wait (TRIGGER_LATE,
    # DecodeConfig.up_late_trigger); one of the two
    TRIGGER_FIRST: tl.constexpr = False,
    TRIGGER_LATE: tl.constexpr = False,
    STAMPS: tl.constexpr = False,  # shard/kernels/stamps.py
):
    let_dependents_launch(TRIGGER_FIRST)
    program = program_index()
    stamp(stamps_ptr, program, 0, STAMPS)
    # Everything this kernel reads (x, the logits or ids) is the previous kernels' output: the
    # overlap PDL gives here is the launch and block dispatch only.
    wait_for_predecessor(PDL)
    let_dependents_launch(TRIGGER_LATE)
    stamp(stamps_ptr, program, 1, STAMPS)
    if SLOTS_FIRST:
        # Slots fastest: the programs in flight together cover one column range of every slot,
        # so slots that share an expert (batch > 1) read its rows at about the same time (L2).
        slot = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:  # column tiles fastest: one expert's rows in order
        pid_n = tl.program_id(0)
        slot = tl.program_id(1)
    t = slot // TOP_K
    if ROUTE:
        top_v, top_i = route_row(logits_ptr, t.to(tl.int64), E, stride_l, TOP_K, K_POW2,
                                 SOFTMAX_FIRST, RENORMALIZE, BLOCK_E, False)
        pick = tl.arange(0, K_POW2) == slot % TOP_K
        expert = tl.sum(tl.where(pick, top_i, 0), 0)
        if pid_n == 0:
            tl.store(topw_ptr + slot, tl.sum(tl.where(pick, top_v, 0.0), 0))
            tl.store(ids_ptr + slot, expert)
    else:
        expert = tl.load(ids_ptr + slot).to(tl.int32)
    if (expert < 0) | (expert >= E):  # another rank's expert: the down launch skips the slot
        return
    stamp(stamps_ptr, program, 2, STAMPS)  # (after a branch on it: the id has arrived)
    if COUNT:  # noqa: SIM102 - a constexpr, then a runtime test (Triton)
        if pid_n == 0:  # CUDA-graph padding rows have valid 0
            tl.atomic_add(counts_ptr + expert, tl.load(valid_ptr + t))
    rows, row_mask = _tile_rows(pid_n, I, BLOCK_N)
    e64 = expert.to(tl.int64)
    w_rows = w_ptr + e64 * stride_we + rows.to(tl.int64) * stride_wn  # [BLOCK_N]
    x_row = x_ptr + t.to(tl.int64) * stride_xm
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
        acc += _tile_dots(w_rows, row_mask, x_row, k0 + offs_k, H)
    _silu_mul_store(acc, rows, row_mask, s_ptr + e64 * stride_se,
                    inter_ptr + slot.to(tl.int64) * I, pid_n, I, HAS_SCALE, BLOCK_N)
    stamp(stamps_ptr, program, 3, STAMPS)


@triton.jit
def _stream_item_index(v, tile, kept, tiles, SLOTS_FIRST: tl.constexpr):
    """The stream's item number of (kept slot v, row tile): slots fastest (the items in flight
    together, one per program, cover one column range of every slot: slots sharing an expert
    read its rows together, as the gridded launch's order) or row tiles fastest."""
    if SLOTS_FIRST:
        return tile * kept + v
    return v * tiles + tile


@triton.jit
def _stream_item(item, slots, ids, keep, rank, kept, tiles, SLOTS_FIRST: tl.constexpr):
    """_stream_item_index's inverse: item -> (slot, its expert, row tile). slots, ids, keep, rank:
    [SLOTS_POW2] each slot's index, expert id, whether it is held here, its rank among those."""
    if SLOTS_FIRST:
        v = item % kept
        tile = item // kept
    else:
        v = item // tiles
        tile = item % tiles
    pick = keep & (rank == v)  # exactly one slot
    return tl.sum(tl.where(pick, slots, 0), 0), tl.sum(tl.where(pick, ids, 0), 0), tile


# S (n * k) varies with the batch: not specialized (1, multiples of 16), so one compiled variant
# serves every decode batch's CUDA graph (warm_up launches n = 1 only).
@triton.jit(do_not_specialize=["S"])
def _gate_up_stream_kernel(
    x_ptr,  # [n, H] activations
    w_ptr,  # [E, 2I, H] rows 0..I-1 gate, I..2I-1 up
    s_ptr,  # [E, 2I] fp32 scales (HAS_SCALE)
    inter_ptr,  # [n * k, I] out: silu(gate) * up per held slot (other slots' rows: not written)
    ids_ptr,  # [n * k] expert ids (the routing launch's output)
    counts_ptr,  # [E] int64 routing statistics (COUNT)
    valid_ptr,  # [n] int64, 1 for real rows (COUNT)
    S,  # n * k routed slots
    I,
    H,
    E,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    TOP_K: tl.constexpr,
    SLOTS_POW2: tl.constexpr,  # >= S: the ids as one vector
    COUNT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    SLOTS_FIRST: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a programmatic dependent (shard/kernels/pdl.py)
):
    """_gate_up_kernel's given-routing form as a persistent launch (DecodeConfig.up_stream): P
    programs (about one per SM) share the work items (held slot, row tile), item i going to
    program i % P, and each program runs its items' K tiles as ONE flattened, software-pipelined
    stream: one pipeline ramp a program instead of one a (slot, row tile), and the tail is one
    item. Strided items rather than contiguous ranges: the same balance (item counts differ by at
    most one) and the items in flight together are consecutive ones, as the gridded launch runs
    them. Only the slots held here (ids in [0, E)) are items: another rank's slots take no
    program time and read nothing, and their inter rows are not written."""
    let_dependents_launch(PDL)
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    # Everything below depends on the ids and x, the previous kernels' output: no weight tile
    # can be loaded before the wait (its expert is not known yet).
    wait_for_predecessor(PDL)
    slots = tl.arange(0, SLOTS_POW2)
    ids = tl.load(ids_ptr + slots, mask=slots < S, other=-1).to(tl.int32)  # [SLOTS_POW2]
    keep = (ids >= 0) & (ids < E)
    rank = tl.cumsum(keep.to(tl.int32), 0) - 1  # [SLOTS_POW2] held slots: 0, 1, ...
    kept = tl.sum(keep.to(tl.int32), 0)
    tiles = tl.cdiv(I, BLOCK_N // 2)
    if COUNT:
        # Each held slot once, by the program of its row tile 0 (as the gridded launch's tile-0
        # programs); CUDA-graph padding rows have valid 0.
        mine = keep & (_stream_item_index(rank, 0, kept, tiles, SLOTS_FIRST) % num_progs == pid)
        rows_valid = tl.load(valid_ptr + slots // TOP_K, mask=mine, other=0)
        tl.atomic_add(counts_ptr + tl.where(mine, ids, 0), rows_valid, mask=mine)
    k_tiles = tl.cdiv(H, BLOCK_K)
    # items pid, pid + P, ... below kept * tiles (kept * tiles - pid > -P: never negative)
    my_items = tl.cdiv(kept * tiles - pid, num_progs)
    kept_or_1 = tl.maximum(kept, 1)  # the item decode's divisor (no iteration when kept = 0)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # it: (my item j, K tile kt). The pipeliner issues iteration it + STAGES - 1's copies during
    # iteration it, whichever item it belongs to: the next item's first tiles stream during this
    # item's last tile and epilogue (the sm_90 test checks the loop compiles to cp.async stages).
    for it in tl.range(0, my_items * k_tiles, num_stages=STAGES):
        j = it // k_tiles
        kt = it - j * k_tiles
        slot, expert, tile = _stream_item(pid + j * num_progs, slots, ids, keep, rank,
                                          kept_or_1, tiles, SLOTS_FIRST)
        rows, row_mask = _tile_rows(tile, I, BLOCK_N)
        e64 = expert.to(tl.int64)
        w_rows = w_ptr + e64 * stride_we + rows.to(tl.int64) * stride_wn  # [BLOCK_N]
        x_row = x_ptr + (slot // TOP_K).to(tl.int64) * stride_xm
        acc += _tile_dots(w_rows, row_mask, x_row, kt * BLOCK_K + offs_k, H)
        if kt == k_tiles - 1:  # the item's last K tile: its outputs, then the next item's sums
            _silu_mul_store(acc, rows, row_mask, s_ptr + e64 * stride_se,
                            inter_ptr + slot.to(tl.int64) * I, tile, I, HAS_SCALE, BLOCK_N)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)


@triton.jit
def _down_stream(inter_ptr, w_ptr, s_ptr, ids, wts, ks, t, rows, row_mask, I, stride_we,
                 stride_wn, stride_se, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr,
                 BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """_down_sum_kernel's weighted sum for its BLOCK_N output rows: ids, wts [K_POW2] the
    token's slots' experts (-1: dropped) and routing weights. -> [BLOCK_N] fp32"""
    offs_k = tl.arange(0, BLOCK_K)
    k_tiles = tl.cdiv(I, BLOCK_K)
    total = tl.zeros(rows.shape, dtype=tl.float32)
    # One stream over (slot j, K tile): the pipelining runs across the slots' boundaries.
    for it in tl.range(0, TOP_K * k_tiles, num_stages=STAGES):
        j = it // k_tiles
        k = (it % k_tiles) * BLOCK_K + offs_k
        pick = ks == j
        expert = tl.sum(tl.where(pick, ids, 0), 0)
        k_lim = tl.where(expert >= 0, I, 0)  # a dropped slot reads nothing
        e64 = tl.maximum(expert, 0).to(tl.int64)
        k_mask = k < k_lim
        w = tl.load(w_ptr + e64 * stride_we + rows[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K]
        a = tl.load(inter_ptr + (t * TOP_K + j) * I + k, mask=k_mask, other=0.0).to(tl.float32)
        part = tl.sum(w.to(tl.float32) * a[None, :], axis=1)  # [BLOCK_N]
        scale = tl.sum(tl.where(pick, wts, 0.0), 0)
        if HAS_SCALE:
            part = part * tl.load(s_ptr + e64 * stride_se + rows, mask=row_mask, other=0.0)
        total += part * scale
    return total


@triton.jit
def _held_ids(slot_ids_ptr, ks, kmask, E):
    """A token's slots' expert ids (slot_ids_ptr: its first slot's) [K_POW2] int32, -1 for a
    slot not held here (outside [0, E): another rank's expert) or past TOP_K."""
    ids = tl.load(slot_ids_ptr + ks, mask=kmask, other=-1).to(tl.int32)
    return tl.where(kmask & (ids >= 0) & (ids < E), ids, -1)


@triton.jit
def _down_sum_kernel(
    inter_ptr,  # [n * k, I]
    w_ptr,  # [E, H, I]
    s_ptr,  # [E, H] fp32 scales (HAS_SCALE)
    out_ptr,  # [n, H]
    topw_ptr,  # [n * k] fp32 routing weights
    ids_ptr,  # [n * k] expert ids
    H,
    I,
    E,
    stride_we,
    stride_wn,
    stride_se,
    stride_om,
    stamps_ptr,  # STAMPS: int64 [programs, STAMP_SLOTS] (DOWN_SUM_STAMP_POINTS)
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    SLOTS_FIRST: tl.constexpr,
    PDL: tl.constexpr = False,
    EARLY_IDS: tl.constexpr = False,  # DecodeConfig.down_early_ids
    STAMPS: tl.constexpr = False,  # shard/kernels/stamps.py
):
    let_dependents_launch(PDL)
    program = program_index()
    stamp(stamps_ptr, program, 0, STAMPS)
    if SLOTS_FIRST:  # tokens fastest (L2 reuse of shared experts, as above)
        t = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1)
    else:
        pid_n = tl.program_id(0)
        t = tl.program_id(1).to(tl.int64)
    ks = tl.arange(0, K_POW2)
    kmask = ks < TOP_K
    slot_ids = ids_ptr + t * TOP_K
    if EARLY_IDS:
        # Before the wait: the slots' expert ids, a guess (final when the routing launch
        # completed before the gate/up launch started, as a plain routing launch without
        # route_trigger does), so the weight stream's first tiles are issued right after the
        # wait instead of one L2 round trip later.
        guess = _held_ids(slot_ids, ks, kmask, E)
    wait_for_predecessor(PDL)  # the slots' ids and inter rows: final from here on
    stamp(stamps_ptr, program, 1, STAMPS)
    ids = _held_ids(slot_ids, ks, kmask, E)  # [K_POW2]
    wts = tl.where(ids >= 0, tl.load(topw_ptr + t * TOP_K + ks, mask=kmask, other=0.0), 0.0)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < H
    if EARLY_IDS:
        total = _down_stream(inter_ptr, w_ptr, s_ptr, guess, wts, ks, t, rows, row_mask, I,
                             stride_we, stride_wn, stride_se, TOP_K, HAS_SCALE, BLOCK_K, STAGES)
        if tl.sum((guess != ids).to(tl.int32), 0) > 0:  # a stale guess: the stream again
            total = _down_stream(inter_ptr, w_ptr, s_ptr, ids, wts, ks, t, rows, row_mask, I,
                                 stride_we, stride_wn, stride_se, TOP_K, HAS_SCALE, BLOCK_K,
                                 STAGES)
    else:
        total = _down_stream(inter_ptr, w_ptr, s_ptr, ids, wts, ks, t, rows, row_mask, I,
                             stride_we, stride_wn, stride_se, TOP_K, HAS_SCALE, BLOCK_K, STAGES)
    tl.store(out_ptr + t * stride_om + rows, total.to(out_ptr.dtype.element_ty), mask=row_mask)
    stamp(stamps_ptr, program, 2, STAMPS)


@triton.jit
def _down_split_kernel(
    inter_ptr,  # [n * k, I]
    w_ptr,  # [E, H, I]
    s_ptr,  # [E, H] fp32 scales (HAS_SCALE)
    out_ptr,  # [n, H]
    part_ptr,  # [n * k, H] fp32 scratch: each slot's down row (scaled by the fp8 scales)
    ticket_ptr,  # [>= n * row blocks] int32, zero between launches
    topw_ptr,  # [n * k] fp32 routing weights
    ids_ptr,  # [n * k] expert ids
    H,
    I,
    E,
    stride_we,
    stride_wn,
    stride_se,
    stride_om,
    stamps_ptr,  # STAMPS: int64 [programs, STAMP_SLOTS] (DOWN_SPLIT_STAMP_POINTS)
    TOP_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # DecodeConfig.down_split: output rows per program
    BLOCK_K: tl.constexpr,  # K tile (>= I: the slot's whole slice in one tile)
    STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
    STAMPS: tl.constexpr = False,  # shard/kernels/stamps.py
):
    let_dependents_launch(PDL)
    program = program_index()
    stamp(stamps_ptr, program, 0, STAMPS)
    slot = tl.program_id(0)  # slots fastest: a row block's k programs run (and finish) together
    pid_n = tl.program_id(1)
    slot64 = slot.to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < H
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    # Before the wait (PDL: during the gate/up launch): the slot's expert id, a guess (final when
    # the routing completed before the gate/up launch started, as the plain routing launch does;
    # a PDL routing or router launch may still be writing it), and the first K tile of its rows.
    guess = tl.load(ids_ptr + slot).to(tl.int32)
    guess = tl.where((guess >= 0) & (guess < E), guess, -1)
    k_first = offs_k < tl.where(guess >= 0, I, 0)  # a dropped slot reads nothing
    w_first = tl.load(w_rows + tl.maximum(guess, 0).to(tl.int64) * stride_we + offs_k[None, :],
                      mask=row_mask[:, None] & k_first[None, :], other=0.0,
                      eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K]
    wait_for_predecessor(PDL)  # ids, weights, inter rows: final from here on
    stamp(stamps_ptr, program, 1, STAMPS)
    expert = tl.load(ids_ptr + slot).to(tl.int32)
    expert = tl.where((expert >= 0) & (expert < E), expert, -1)
    e_rows = w_rows + tl.maximum(expert, 0).to(tl.int64) * stride_we
    again = expert != guess  # a stale guess: its tile loaded again (else no bytes)
    k_again = offs_k < tl.where(again & (expert >= 0), I, 0)
    w = tl.load(e_rows + offs_k[None, :], mask=row_mask[:, None] & k_again[None, :], other=0.0,
                eviction_policy="evict_first")
    w = tl.where(again, w, w_first)
    k_lim = tl.where(expert >= 0, I, 0)
    a_row = inter_ptr + slot64 * I
    a = tl.load(a_row + offs_k, mask=offs_k < k_lim, other=0.0).to(tl.float32)
    acc2 = w.to(tl.float32) * a[None, :]  # [BLOCK_N, BLOCK_K] fp32, one row sum at the end
    for k0 in tl.range(BLOCK_K, I, BLOCK_K, num_stages=STAGES):  # none when BLOCK_K >= I
        k = k0 + offs_k
        k_mask = k < k_lim
        w = tl.load(e_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")
        a = tl.load(a_row + k, mask=k_mask, other=0.0).to(tl.float32)
        acc2 += w.to(tl.float32) * a[None, :]
    part = tl.sum(acc2, axis=1)  # [BLOCK_N]
    if HAS_SCALE:
        part = part * tl.load(s_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_se + rows,
                              mask=row_mask, other=0.0)
    tl.store(part_ptr + slot64 * H + rows, part, mask=row_mask)
    stamp(stamps_ptr, program, 2, STAMPS)
    # Every thread's partial precedes the ticket; the acq_rel atomic publishes it to (and, for
    # the last program of the row block, acquires the others' from) the whole GPU
    # (moe_router's and the decode attention's split merge).
    tl.debug_barrier()
    t = slot // TOP_K
    ticket_at = ticket_ptr + t * tl.num_programs(1) + pid_n
    ticket = tl.atomic_add(ticket_at, 1, sem="acq_rel", scope="gpu")
    stamp(stamps_ptr, program, 3, STAMPS)
    if ticket == TOP_K - 1:
        tl.store(ticket_at, 0)  # all k programs of this (token, row block) have taken theirs
        # The k partials in slot order, each times its routing weight, summed in fp32 and
        # rounded once: _down_sum_kernel's rounding points (its per-slot row sums add the K
        # tiles in another order: fp32 reassociation only).
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            sj = t * TOP_K + j
            ej = tl.load(ids_ptr + sj).to(tl.int32)
            keep = (ej >= 0) & (ej < E)
            wj = tl.where(keep, tl.load(topw_ptr + sj), 0.0)
            pj = tl.load(part_ptr + sj.to(tl.int64) * H + rows,
                         mask=rows < tl.where(keep, H, 0), other=0.0,
                         cache_modifier=".cg")  # other SMs wrote it: past the L1
            total += pj * wj
        tl.store(out_ptr + t.to(tl.int64) * stride_om + rows,
                 total.to(out_ptr.dtype.element_ty), mask=row_mask)
        stamp(stamps_ptr, program, 4, STAMPS)


# The expert launches' stamp points (shard/kernels/stamps.py), by stamp slot
GATE_UP_STAMP_POINTS = ("start", "after the PDL wait", "expert id in", "stored")
DOWN_SUM_STAMP_POINTS = ("start", "after the PDL wait", "stored")
DOWN_SPLIT_STAMP_POINTS = ("start", "after the PDL wait", "partial stored", "ticket taken",
                           "merged")


# The split down launch's counters, one per (token, row block) of a launch
# (shard/kernels/tickets.py); the first allocation covers 32 tokens x hidden 8192 at 4 rows.
_SPLIT_TICKETS = TicketCounters("moe_decode split down", 1 << 16)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; 3 under the interpreter (CPU tensors: fewer programs than items, and
    counts that do not divide them, so the tests see programs looping over several)."""
    if device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


def _gate_up_stream(
    x: torch.Tensor,  # [n, H]
    w13: torch.Tensor,  # [E, 2I, H]
    scale13: torch.Tensor | None,  # [E, 2I] float32 with fp8 weights
    inter: torch.Tensor,  # [n * k, I] out
    ids: torch.Tensor,  # [n * k] expert ids
    count_into: torch.Tensor | None,  # [E] int64 routing statistics
    valid: torch.Tensor | None,  # [n] int64 (with count_into)
    top_k: int,
    cfg: DecodeConfig,
) -> None:
    """Launch 1 as the persistent stream (cfg.up_stream): min(items, up_stream x SMs) programs,
    items = n * k slots x row tiles (the launch takes the held slots' items only)."""
    slots, inter_dim = inter.shape
    num_experts, _, hidden = w13.shape
    items = slots * triton.cdiv(inter_dim, cfg.up_block_n // 2)
    programs = min(items, cfg.up_stream * _sm_count(x.device))
    dummy = ids  # the pointers a variant without scales / statistics never reads
    _gate_up_stream_kernel[(programs,)](
        x, w13, scale13 if scale13 is not None else dummy, inter, ids,
        count_into if count_into is not None else dummy,
        valid if count_into is not None else dummy,
        slots, inter_dim, hidden, num_experts,
        x.stride(0), w13.stride(0), w13.stride(1),
        scale13.stride(0) if scale13 is not None else 0,
        TOP_K=top_k,
        # one variant for every decode-sized batch (warm_up launches n = 1 only)
        SLOTS_POW2=triton.next_power_of_2(max(slots, DECODE_MAX_SLOTS)),
        COUNT=count_into is not None, HAS_SCALE=scale13 is not None,
        BLOCK_N=cfg.up_block_n, BLOCK_K=cfg.up_block_k, STAGES=cfg.stages,
        SLOTS_FIRST=cfg.slots_first, num_warps=cfg.up_warps, num_stages=cfg.stages,
        **pdl.launch_options(x.device),
    )


def moe_decode(
    x: torch.Tensor,  # [n, H] bf16/fp16 (fp32 under the interpreter)
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    top_k: int,
    scale13: torch.Tensor | None = None,  # [E, 2I] float32 with fp8 weights
    scale2: torch.Tensor | None = None,  # [E, H] float32 with fp8 weights
    config: DecodeConfig | None = None,
    *,
    topk_weights: torch.Tensor | None = None,  # [n, k] float32 (given routing)
    topk_ids: torch.Tensor | None = None,  # [n, k] int; ids outside [0, E) contribute nothing
    logits: torch.Tensor | None = None,  # [n, E] router logits (routing inside launch 1)
    routing: MoeRouting | None = None,  # with logits
    count_into: torch.Tensor | None = None,  # [E] int64: adds routed slots per expert
    valid: torch.Tensor | None = None,  # [n] int64: only rows with valid != 0 are counted
) -> torch.Tensor:
    """sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j] -> [n, H] x.dtype,
    routing either given (topk_weights, topk_ids) or computed from `logits` with `routing`."""
    n, hidden = x.shape
    num_experts, inter2, _ = w13.shape
    inter_dim = inter2 // 2
    slots = n * top_k
    cfg = config or decode_config_for(slots, scale13 is not None) or \
        DECODE_CONFIGS[scale13 is not None][-1][1]
    x = x.contiguous()
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    route = logits is not None
    if route:
        assert routing is not None and routing.top_k == top_k
        weights = torch.empty(slots, dtype=torch.float32, device=x.device)
        ids = torch.empty(slots, dtype=torch.int32, device=x.device)
    else:
        assert topk_weights is not None and topk_ids is not None
        weights = topk_weights.reshape(-1).float().contiguous()
        ids = topk_ids.reshape(-1).contiguous()
    inter = torch.empty(slots, inter_dim, dtype=x.dtype, device=x.device)
    k_pow2 = triton.next_power_of_2(top_k)
    count = count_into is not None
    if count and valid is None:  # int64 as RoutingStats' rows (one compiled variant)
        valid = torch.ones(n, dtype=torch.int64, device=x.device)
    up_tiles = triton.cdiv(inter_dim, cfg.up_block_n // 2)
    if cfg.up_stream:
        assert not route, "the persistent gate/up launch takes given routing"
        _gate_up_stream(x, w13, scale13, inter, ids, count_into if count else None, valid, top_k,
                        cfg)
    else:
        up_stamps = take_stamps("gate/up", slots * up_tiles, GATE_UP_STAMP_POINTS)
        _gate_up_kernel[(slots, up_tiles) if cfg.slots_first else (up_tiles, slots)](
            x, w13, scale13 if scale13 is not None else weights, inter,
            logits if route else x, weights, ids,
            count_into if count else weights, valid if count else weights,
            inter_dim, hidden, num_experts,
            x.stride(0), w13.stride(0), w13.stride(1),
            scale13.stride(0) if scale13 is not None else 0,
            logits.stride(0) if route else 0,
            up_stamps if up_stamps is not None else weights,
            TOP_K=top_k, K_POW2=k_pow2, ROUTE=route,
            SOFTMAX_FIRST=routing.softmax_first if route else True,
            RENORMALIZE=routing.renormalize if route else False,
            BLOCK_E=triton.next_power_of_2(num_experts), COUNT=count,
            HAS_SCALE=scale13 is not None,
            BLOCK_N=cfg.up_block_n, BLOCK_K=cfg.up_block_k, STAGES=cfg.stages,
            SLOTS_FIRST=cfg.slots_first, num_warps=cfg.up_warps, num_stages=cfg.stages,
            TRIGGER_FIRST=pdl.enabled(x.device) and not cfg.up_late_trigger,
            TRIGGER_LATE=pdl.enabled(x.device) and cfg.up_late_trigger,
            STAMPS=up_stamps is not None,
            **pdl.launch_options(x.device),
        )
    stages = cfg.down_stages or cfg.stages
    if cfg.down_split:
        row_blocks = triton.cdiv(hidden, cfg.down_split)
        tickets = _SPLIT_TICKETS.take(x.device, n * row_blocks)
        partials = torch.empty(slots, hidden, dtype=torch.float32, device=x.device)
        split_stamps = take_stamps("down split", slots * row_blocks, DOWN_SPLIT_STAMP_POINTS)
        _down_split_kernel[(slots, row_blocks)](
            inter, w2, scale2 if scale2 is not None else weights, out, partials, tickets,
            weights, ids, hidden, inter_dim, num_experts, w2.stride(0), w2.stride(1),
            scale2.stride(0) if scale2 is not None else 0, out.stride(0),
            split_stamps if split_stamps is not None else weights,
            TOP_K=top_k, HAS_SCALE=scale2 is not None, BLOCK_N=cfg.down_split,
            BLOCK_K=cfg.down_block_k, STAGES=stages, num_warps=cfg.down_warps,
            num_stages=stages, STAMPS=split_stamps is not None, **pdl.launch_options(x.device),
        )
        return out
    down_tiles = triton.cdiv(hidden, cfg.down_block_n)
    sum_stamps = take_stamps("down+sum", n * down_tiles, DOWN_SUM_STAMP_POINTS)
    _down_sum_kernel[(n, down_tiles) if cfg.slots_first else (down_tiles, n)](
        inter, w2, scale2 if scale2 is not None else weights, out, weights, ids,
        hidden, inter_dim, num_experts,
        w2.stride(0), w2.stride(1), scale2.stride(0) if scale2 is not None else 0, out.stride(0),
        sum_stamps if sum_stamps is not None else weights,
        TOP_K=top_k, K_POW2=k_pow2, HAS_SCALE=scale2 is not None,
        BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k, STAGES=stages,
        SLOTS_FIRST=cfg.slots_first, EARLY_IDS=cfg.down_early_ids, num_warps=cfg.down_warps,
        num_stages=stages, STAMPS=sum_stamps is not None, **pdl.launch_options(x.device),
    )
    return out


def warm_up(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: MoeRouting,
            scale13: torch.Tensor | None, scale2: torch.Tensor | None,
            count_into: torch.Tensor | None) -> None:
    """Compiles and loads every decode config of the table for the layer's call (routing from
    logits, statistics as the layer keeps them), eagerly before any CUDA-graph capture."""
    num_experts, hidden = w13.shape[0], x.shape[-1]
    one = torch.zeros(1, hidden, dtype=x.dtype, device=x.device)
    logits = torch.zeros(1, num_experts, dtype=x.dtype, device=x.device)
    scratch = torch.zeros_like(count_into) if count_into is not None else None
    for _, cfg in DECODE_CONFIGS[scale13 is not None]:
        decode_layer(one, logits, w13, w2, routing, scale13, scale2, cfg, scratch)


def decode_layer(
    x: torch.Tensor,  # [n, H]
    logits: torch.Tensor,  # [n, E]
    w13: torch.Tensor,
    w2: torch.Tensor,
    routing: MoeRouting,
    scale13: torch.Tensor | None,
    scale2: torch.Tensor | None,
    config: DecodeConfig,
    count_into: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """FusedMoE's decode-sized forward: routing inside the gate/up launch or as its own launch
    (config.route_inside), then moe_decode. -> [n, H]"""
    if config.route_inside:
        return moe_decode(x, w13, w2, routing.top_k, scale13, scale2, config, logits=logits,
                          routing=routing, count_into=count_into, valid=valid)
    from shard.kernels import moe_route

    weights, ids = moe_route.route(logits, routing, config.route_warps, config.route_trigger,
                                   config.route_dependent, config.route_sorted)
    return moe_decode(x, w13, w2, routing.top_k, scale13, scale2, config, topk_weights=weights,
                      topk_ids=ids, count_into=count_into, valid=valid)
