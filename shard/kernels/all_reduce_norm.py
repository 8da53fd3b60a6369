"""The kernels of the fused all-reduce + residual add + RMSNorm, for decode-sized tensor-parallel
steps.

Why: in a tensor-parallel layer every row-parallel output (o_proj, down_proj) is summed over ranks
and then immediately added to the residual stream and RMS-normalized for the next projection. As
separate kernels that is an all-reduce (~7 us for [1, 4096] bf16 on 2 H200s even as PyTorch's
one-shot symmetric-memory kernel, whose two barriers are NVLink round trips) plus a fused
add+norm (~2 us), 64 times per Llama-3-8B step: ~0.6 ms of a ~3.5 ms TP=2 batch-1 step
(benchmarks/QUANT_TP.md). This module does all three in one Triton kernel (a program per row)
with no barrier at all: 5.4 us at [1, 4096] bf16 on 2 H200s (6.3 us at 8 rows).

How (a "Lamport" exchange, the scheme TensorRT-LLM uses for small all-reduces): every rank owns an
exchange buffer that all peers have mapped (torch symmetric memory, NVLink/P2P, no multicast),
laid out [3 slots][world senders][max_rows][hidden] of 16-bit words and filled with -0.0
(bits 0x8000), which marks "not written yet". A call
  1. pushes this rank's partial rows into slot `s` of EVERY rank's buffer (its own included), with
     -0.0 rewritten as +0.0 (the same number) so real data is never the mark. Under tensor
     parallelism the row-parallel GEMV that produces the rows does this from its epilogue
     (`push_to_exchange`; RowParallelLinear.partial(push=True)): the remote stores then overlap
     the GEMV's tail and the launch gap, and the kernel (`reduce_pushed`) only waits;
  2. spins on its own buffer until no word of any sender's rows in slot `s` is the mark (each
     word is stored whole, so "not the mark" means "final"), then sums the senders in rank order
     (fp32; every rank adds in the same order, so all ranks get bit-identical results), adds the
     residual and normalizes, with the same rounding points as shard.kernels.elementwise.add_rms_norm;
  3. resets slot s-1 (the previous call's) to the mark, and advances the call counter.
Slots rotate through 3 so that a reset can never race a push: a peer can be at most one call
ahead (it cannot finish call c+1 without our push for c+1), so while we are in call c peers write
only slots c and c+1, and slot c-1 is ours to clear. The counter (and each slot's row count, so a
reset clears exactly what was written) lives in device memory: CUDA-graph replays and eager calls
advance it alike. The reset covers the rows and the columns the previous call wrote, whatever
this call's shape: two models of different widths may share one exchange (a start-up self-check
at 4096 columns before a narrower model, or the multi-GPU test's tiny model before its 4096-wide
checks), and clearing only this call's columns once left the wider call's tail words behind as
"written" data for a later wide call to sum. All ranks must make the same calls in the same order, as with any collective;
the path is chosen from shapes alone, so they do.

A wait that never ends (a dead peer) is cut off after SPIN_LIMIT polls and recorded in the state
(`failed()`); the start-up self-check (`try_all_reduce_add_rms_norm`) uses that to fall back to the
unfused path instead of hanging. The collective around these kernels (buffer rendezvous, the start-up self-check) is
shard/distributed/all_reduce_norm.py. Imported only on CUDA (Triton).
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from shard.kernels import pdl
from shard.kernels.pdl import let_dependents_launch, wait_for_predecessor

# Bits of -0.0 in bf16 and fp16 as a signed 16-bit word: the "not written yet" mark.
EMPTY = tl.constexpr(-32768)
# Polls of one sender's row before giving up (each poll is a ~1 us volatile read: ~10-20 s).
SPIN_LIMIT = tl.constexpr(1 << 24)
# state tensor layout: [call counter, rows written in slot 0, 1, 2, failed flag, programs done,
# columns written in slot 0, 1, 2]
STATE_WORDS = 9
SLOTS = 3


@triton.jit
def _buffer(buffers_ptr, rank):
    """Rank `rank`'s exchange buffer as an int16 pointer. Symmetric-memory buffers are 16-byte
    aligned; saying so lets Triton issue 16-byte loads and stores (without the hint every word
    of a row is a separate 2-byte NVLink transaction)."""
    return tl.multiple_of(tl.load(buffers_ptr + rank).to(tl.pointer_type(tl.int16)), 16)


@triton.jit
def push_to_exchange(
    bits,  # [R, C] int16: model-dtype values bit-cast
    rows,  # [R] row indices (< MAX_ROWS)
    cols,  # [C] column indices (< MAX_HIDDEN)
    mask,  # [R, C]
    call,  # the state's call counter (read before any reduce of this call)
    buffers_ptr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    MAX_ROWS: tl.constexpr,
    MAX_HIDDEN: tl.constexpr,
):
    """Step 1 of a call: this rank's values into slot call % 3, sender RANK, of every rank's
    buffer (its own included), -0.0 rewritten as +0.0 so real data is never the mark. Called by
    the fused kernel itself or, earlier, by the epilogue of the GEMV that produces the values
    (shard.kernels.gemv, PUSH): then the remote stores overlap the GEMV's tail instead of
    starting the all-reduce's critical path."""
    bits = tl.where(bits == EMPTY, 0, bits).to(tl.int16)
    slot_base = (call % 3).to(tl.int64) * (WORLD * MAX_ROWS * MAX_HIDDEN)
    at = slot_base + (RANK * MAX_ROWS + rows[:, None]) * MAX_HIDDEN + cols[None, :]
    for peer in tl.static_range(WORLD):
        tl.store(_buffer(buffers_ptr, peer) + at, bits, mask=mask)


# `rows` varies per call (1 would otherwise compile a variant of its own); `hidden` stays
# specialized: it is fixed per model, and its divisibility by 16 lets the row loads go 16 bytes
# wide (masks of unknown alignment force 2-byte accesses).
@triton.jit(do_not_specialize=["rows"])
def _all_reduce_add_rms_norm_kernel(
    partial_ptr,  # [rows, hidden] int16 view of this rank's un-reduced model-dtype output
    x_ptr,  # [rows, hidden] model dtype, residual stream before the add
    w_ptr,  # [hidden] norm weight
    out_ptr,  # [rows, hidden] model dtype: rms_norm(x + sum over ranks of partial) * w
    res_ptr,  # [rows, hidden] model dtype: x + sum over ranks of partial
    buffers_ptr,  # [WORLD] int64: every rank's exchange buffer, as mapped in this process
    state_ptr,  # [STATE_WORDS] int32
    rows,
    hidden,
    stride_p,
    stride_x,
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    MAX_ROWS: tl.constexpr,
    MAX_HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    PUSHED: tl.constexpr,  # the partial rows are already in the buffers (partial_ptr unused)
    PDL: tl.constexpr = False,  # launched as a programmatic dependent (shard/kernels/pdl.py)
):
    # The next GEMV may be launched now and stream its first weight tile while this kernel
    # waits on NVLink; nothing (the state, the buffers) is touched before the previous kernel
    # is done, so the exchange protocol below is the same as without PDL.
    let_dependents_launch(PDL)
    wait_for_predecessor(PDL)
    # One program per row: rows are independent until the end, where the last program to
    # finish advances the call counter.
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    call = tl.load(state_ptr)
    slot = call % 3
    # Fixed strides of the [slot][sender][row][MAX_HIDDEN] buffer, independent of `rows` and
    # `hidden`, so a slot's words mean the same thing to every rank in every call.
    slot_words = WORLD * MAX_ROWS * MAX_HIDDEN
    slot_base = slot.to(tl.int64) * slot_words
    own = _buffer(buffers_ptr, RANK)

    # 1. push: this rank's row into slot `slot`, sender RANK, of every rank's buffer (unless the
    # row-parallel GEMV's epilogue already did: PUSHED).
    if not PUSHED:
        bits = tl.load(partial_ptr + row * stride_p + offs, mask=mask, other=0)
        push_to_exchange(bits[None, :], row + tl.arange(0, 1), offs, mask[None, :], call,
                         buffers_ptr, RANK, WORLD, MAX_ROWS, MAX_HIDDEN)

    # 2. wait for every sender's row, sum in rank order, add the residual, normalize.
    timed_out = tl.full([], 0, tl.int32)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for sender in tl.static_range(WORLD):
        src = own + slot_base + (sender * MAX_ROWS + row) * MAX_HIDDEN + offs
        words = tl.load(src, mask=mask, other=0, volatile=True)
        pending = tl.max((words == EMPTY).to(tl.int32), axis=0)
        polls = tl.full([], 0, tl.int32)
        while (pending > 0) & (polls < SPIN_LIMIT):
            words = tl.load(src, mask=mask, other=0, volatile=True)
            pending = tl.max((words == EMPTY).to(tl.int32), axis=0)
            polls += 1
        timed_out = tl.maximum(timed_out, pending)
        total += words.to(x_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
    # Same rounding points as the unfused path: the all-reduce's result in the model dtype,
    # x + d rounded, RMSNorm of the rounded sum, (s * rstd) rounded, then * w.
    d = total.to(x_ptr.dtype.element_ty).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    s = (x + d).to(res_ptr.dtype.element_ty)
    tl.store(res_ptr + row * hidden + offs, s, mask=mask)
    s = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s * s, axis=0) / hidden + eps)
    y = (s * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)

    # 3. reset the previous call's slot (all it held: its row and column counts are in the
    # state, and may exceed this call's; programs share the rows) and let the last program to
    # finish advance the counter.
    prev = (call + 2) % 3
    prev_rows = tl.load(state_ptr + 1 + prev)
    prev_cols = tl.load(state_ptr + 6 + prev)
    prev_base = prev.to(tl.int64) * slot_words
    empty = tl.full([BLOCK], EMPTY, tl.int16)
    for stale in range(row, prev_rows, rows):
        for col0 in range(0, prev_cols, BLOCK):
            cols = col0 + offs
            for sender in tl.static_range(WORLD):
                tl.store(own + prev_base + (sender * MAX_ROWS + stale) * MAX_HIDDEN + cols,
                         empty, mask=cols < prev_cols)
    if timed_out > 0:
        tl.store(state_ptr + 4, 1)
    # Every thread has read `call` by now (the reductions above synchronize the block); the
    # barrier makes that explicit before any thread may overwrite it.
    tl.debug_barrier()
    if rows == 1:  # the decode batch-1 case: no other program, no atomic needed
        tl.store(state_ptr + 1 + slot, rows)
        tl.store(state_ptr + 6 + slot, hidden)
        tl.store(state_ptr, call + 1)
    else:
        # A scalar atomic runs once per program. Every program takes its ticket after its last
        # read of `call`, so the last ticket holder may advance it.
        ticket = tl.atomic_add(state_ptr + 5, 1, sem="acq_rel")
        if ticket == rows - 1:
            tl.store(state_ptr + 5, 0)
            tl.store(state_ptr + 1 + slot, rows)
            tl.store(state_ptr + 6 + slot, hidden)
            tl.store(state_ptr, call + 1)


class ExchangeTarget(Protocol):
    """What a producer kernel needs to push its output into the exchange (the GEMV's PUSH
    epilogue): shard.distributed.all_reduce_norm.AllReduceAddRmsNorm implements it."""

    def exchange_args(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
        """(buffer pointers [world] int64, state [STATE_WORDS] int32, the constexprs RANK,
        WORLD, MAX_ROWS, MAX_HIDDEN)."""
        ...


def all_reduce_add_rms_norm(
    partial: torch.Tensor | None,  # [rows, hidden] un-reduced; None: already pushed
    x: torch.Tensor,  # [rows, hidden] residual stream
    weight: torch.Tensor,  # [hidden]
    eps: float,
    buffer_ptrs: torch.Tensor,  # [world] int64, every rank's exchange buffer
    state: torch.Tensor,  # [STATE_WORDS] int32
    consts: dict[str, int],  # RANK, WORLD, MAX_ROWS, MAX_HIDDEN
    num_warps: int | None,  # None: 8 from 4096 columns, else 4 (add_rms_norm's choice)
) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of the exchange: (rms_norm(x + sum) * w, x + sum), each [rows, hidden]."""
    rows, hidden = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    res = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(hidden)
    pushed = partial is None
    _all_reduce_add_rms_norm_kernel[(rows,)](
        x if pushed else partial.view(torch.int16), x, weight, out, res, buffer_ptrs,
        state, rows, hidden, 0 if pushed else partial.stride(0), x.stride(0), eps,
        **consts, BLOCK=block, PUSHED=pushed,
        num_warps=num_warps or (8 if block >= 4096 else 4),
        **pdl.launch_options(x.device),
    )
    return out, res
