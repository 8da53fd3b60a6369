"""Batched LoRA for the CUDA path: every row of a step applies its own adapter (punica-style
shrink then expand), so that requests for different adapters and the base model share one batch.

Two forms. The FOLDED one (the bottom of this module; what the shard runs wherever the base
linear has a plain 16-bit or fp32 weight) has no shrink kernel: every slot's A rides as extra rows
of the base weight, the base GEMM writes every slot's x @ A^T next to the base output, and one
expand per linear reads each row's own slot's part of it (measured on an H100 at batch 64, a
linear's shrink + expand pair below cost 14-28 us, 77-92 us per layer for the four: launches
and serial latency, not bytes; benchmarks/LORA.md). The shrink + expand kernels
right below remain for quantized base linears (fp8 / int8 / nf4 weights cannot carry 16-bit A
rows).

Adapters live in stacked buffers at fixed addresses (a slot per resident adapter):
    A [num_slots, parts * R, K]  (shrink: K input features -> the parts' ranks, stacked)
    B [num_slots, N, parts * R]  (expand: block-diagonal, part p's output columns read only part
                                  p's ranks; the LoRA scaling folded in)
and each row names its slot in `slots` [num_rows] (int32, -1: no adapter). The slot index is a
tensor, so a captured CUDA graph replays with whatever slots the step's rows have.

Design, for decode (batch <= 64 rows, K = 4096..14336, R = 16 per part): the whole LoRA delta of
a layer is ~5-10 MB of memory traffic, i.e. a few microseconds; what costs is launches and
serial latency inside each program. Measured on an H100 (benchmarks/LORA.md) the previous
kernels (a zeroed fp32 buffer per linear, a split-K shrink with atomics, each row tile looping
over the slots its rows use: 12 launches per layer, 4x the serial work with 4 adapters) cost
~110 us per layer with 4 adapters. Here:

- Shrink, one launch per adapted linear (q/k/v's and gate/up's A are already stacked, so one
  per input): grid = (slot, row tile of 16, split of K x rank block of one part). A program
  serves only the rows of its own slot (the others' loads are masked off, so they cost no
  traffic) and exits at once when its tile has none: with 4 adapters the 4 slots' work runs
  in parallel programs, each as short as with 1 adapter, instead of one program looping over
  4 slots. K is split up to 8 ways (4 for gate/up, see SILU_MAX_SPLITS), aiming at ~128
  programs per slot (132 SMs): at batch 64 a slot's rows get 96 programs for q/k/v and 32 for
  o and down (more splits would make the expand sum more partials). Each split
  writes its own fp32 partial [splits, M, parts * R] (rows of slot -1 are never written): no
  zero-initialised buffer, hence no memset launch, and no atomics, so the result does not
  depend on scheduling (bit-reproducible, batch-invariant per row).
- Expand, one launch per adapted linear: grid = (row tile of 64, column tile of 128), the
  column tiles laid out per part so that a tile never straddles q/k/v (or gate/up) and reads
  only its part's R ranks of the block-diagonal B (no traffic for the zero blocks). A program
  sums the partials of its rows (one [splits, rows, R] load) and then computes every row's own
  adapter product in ONE tensor-core dot for all slots: [rows, slots * R] @ [slots * R, cols],
  row i's h placed in its slot's block of R columns (zeros elsewhere), against all slots' B
  tiles stacked along R (<= 128 wide: 8 slots at rank 16). Its loads do not depend on which
  slots are present, so 4 adapters cost one round of loads and one dot, like 1, whatever the
  mix inside the tile (more slots x rank than that: a loop over the slots present). Rejected:
  a bgmv-style per-row gather of B needs a [rows, cols, R] register tile (16x the registers of
  the dot for the same work at 64 rows); sorting rows by slot costs extra launches per step and
  a gather / scatter of x and y.
- gate/up: the expand also does SiLU(gate) * up and writes the MLP activation, replacing the
  separate silu_mul kernel that the base path runs at this batch (cuBLAS GEMM + silu_mul): the
  gate/up LoRA costs one extra launch, the shrink.

So a layer costs 7 launches for LoRA (4 shrinks, 3 expands; the gate/up expand replaces a base
kernel) instead of 12 (+ silu_mul). Arithmetic: products accumulate in fp32; for 16-bit models
h is rounded to the model dtype before its dot with B (as peft's unmerged LoRA does: lora_A's
output is in the model dtype), which halves the expand's operand registers; float32 models use
exact fp32 ("ieee") dots throughout. The delta is added to the base output in fp32 and rounded
once; for gate/up like the unfused path (gate and up to the dtype, silu(gate) to the dtype, then
the product), so base rows get exactly what silu_mul gives them.

CUDA graphs: every argument that changes with the batch bucket (rows, splits, the partials'
split stride) is unspecialised, so the one variant compiled by the eager warm-up run serves
every captured bucket; nothing syncs with the host and nothing is allocated but the partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard.kernels import pdl
from shard.kernels.pdl import let_dependents_launch, wait_for_predecessor

SHRINK_BLOCK_M = 16
SHRINK_BLOCK_K = 128
MAX_SPLITS = 8  # split-K partials (a power of two: the expand loads them as one tile)
# gate/up: the fused expand re-reads the partials for each of its 224 column tiles (Llama-3-8B),
# so fewer, longer splits there (8 would read ~15 MB of partials from L2 per layer)
SILU_MAX_SPLITS = 4
SPLIT_RANKS_MAX = 128  # splits x rank block at most (larger ranks: fewer splits)
SHRINK_TARGET_PROGRAMS = 128  # per slot: row tiles x rank blocks x splits, ~ the SM count
SHRINK_MIN_K_PER_SPLIT = 256
EXPAND_BLOCK_M = 64
EXPAND_BLOCK_N = 128
SILU_BLOCK_N = 64  # two column tiles (gate's and up's) per program
WIDE_MAX_K = 128  # the expand's one dot over all slots: slots x R up to this, else a loop
MAX_PARTS = 3
SHRINK_NUM_WARPS = 4
EXPAND_NUM_WARPS = 8  # the expands' [64, 128] tiles; tests/shard/test_lora_kernels_sm90.py


@triton.jit(do_not_specialize=["num_rows", "k_per_split", "stride_ps"])
def _lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, part_ptr, num_rows, K, part_rank, k_per_split,
                        stride_xm, stride_as, stride_ar, stride_ps, stride_pm,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr, PDL: tl.constexpr):
    let_dependents_launch(PDL)
    wait_for_predecessor(PDL)  # x and the slots are written earlier in the step
    s = tl.program_id(0)  # adapter slot
    pid_m = tl.program_id(1)  # row tile
    pid_kr = tl.program_id(2)  # split of K x rank block (one part's ranks)
    n_rb = tl.num_programs(2) // tl.cdiv(K, k_per_split)
    split = pid_kr // n_rb
    rb = pid_kr % n_rb
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slots_ptr + rows, mask=rows < num_rows, other=-1)
    sel = slot == s  # [BLOCK_M] this program's rows
    if tl.max(sel.to(tl.int32), axis=0) > 0:
        r_in = tl.arange(0, BLOCK_R)
        r_ok = r_in < part_rank
        rr = rb * part_rank + r_in  # this block's rows of the stacked A
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        k_start = split * k_per_split
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
        a_base = a_ptr + s.to(tl.int64) * stride_as + rr[None, :] * stride_ar
        for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            # rows of other slots are masked off: no memory traffic for them
            x = tl.load(x_rows + kk[None, :], mask=sel[:, None] & k_ok[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            a = tl.load(a_base + kk[:, None], mask=k_ok[:, None] & r_ok[None, :],
                        other=0.0)  # [BLOCK_K, BLOCK_R]
            acc += tl.dot(x, a, input_precision=PRECISION)
        out = part_ptr + split.to(tl.int64) * stride_ps + rows[:, None].to(tl.int64) * stride_pm
        tl.store(out + rr[None, :], acc, mask=sel[:, None] & r_ok[None, :])


@triton.jit
def _part_of_tile(pid_n, n_end0, n_end1, n_end2, t_end0, t_end1, BLOCK_N: tl.constexpr):
    """Column tile pid_n -> (part, first column, end column of the part): tiles are numbered
    part by part (t_end* = the tile count before the next part), so none straddles two."""
    p = (pid_n >= t_end0).to(tl.int32) + (pid_n >= t_end1).to(tl.int32)
    part_start = tl.where(p == 0, 0, tl.where(p == 1, n_end0, n_end1))
    tile_start = tl.where(p == 0, 0, tl.where(p == 1, t_end0, t_end1))
    part_end = tl.where(p == 0, n_end0, tl.where(p == 1, n_end1, n_end2))
    return p, part_start + (pid_n - tile_start) * BLOCK_N, part_end


@triton.jit
def _delta(part_ptr, b_ptr, slot, rows, row_ok, cols, col_ok, p, part_rank, num_splits,
           num_slots, stride_ps, stride_pm, stride_bs, stride_bn,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
           MAX_SPLITS: tl.constexpr, WIDE_SLOTS: tl.constexpr, PRECISION: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32: each row's h (the sum of its split partials, part p's ranks)
    @ B[its slot][cols, part p's ranks]^T; 0 for rows of slot -1 (`slot` [BLOCK_M]).

    WIDE_SLOTS > 0 (a power of two >= the slot count): one dot for every slot at once,
    [rows, WIDE_SLOTS * R] @ [WIDE_SLOTS * R, cols], where row i's h sits in its slot's block
    of R columns and zeros elsewhere, against all slots' B tiles stacked along R: one round of
    loads and one dot, whatever the mix of adapters. 0: a loop over the slots present."""
    r_in = tl.arange(0, BLOCK_R)
    r_ok = r_in < part_rank
    rr = p * part_rank + r_in
    h = _split_sum(part_ptr, rows, row_ok, rr, r_ok, num_splits, stride_ps, stride_pm,
                   BLOCK_M, BLOCK_R, MAX_SPLITS)  # [BLOCK_M, BLOCK_R]
    b_tile = b_ptr + cols[None, :].to(tl.int64) * stride_bn + rr[:, None]  # [BLOCK_R, BLOCK_N]
    b_mask = r_ok[:, None] & col_ok[None, :]
    if WIDE_SLOTS > 0:
        s_in = tl.arange(0, WIDE_SLOTS)
        b = tl.load(b_tile[None, :, :] + s_in[:, None, None].to(tl.int64) * stride_bs,
                    mask=b_mask[None, :, :] & (s_in < num_slots)[:, None, None], other=0.0)
        b = tl.reshape(b, [WIDE_SLOTS * BLOCK_R, BLOCK_N])  # slot s's ranks at s * BLOCK_R
        hw = tl.where(slot[:, None, None] == s_in[None, :, None], h[:, None, :], 0.0)
        hw = tl.reshape(hw, [BLOCK_M, WIDE_SLOTS * BLOCK_R])
        acc = tl.dot(hw.to(b.dtype), b, input_precision=PRECISION)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in range(num_slots):
            sel = slot == s
            if tl.max(sel.to(tl.int32), axis=0) > 0:
                b = tl.load(b_tile + s * stride_bs, mask=b_mask, other=0.0)
                hs = tl.where(sel[:, None], h, 0.0)
                acc += tl.dot(hs.to(b.dtype), b, input_precision=PRECISION)
    return acc


@triton.jit
def _split_sum(part_ptr, rows, row_ok, rr, r_ok, num_splits, stride_ps, stride_pm,
               BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """Sum of the split-K partials [BLOCK_M, BLOCK_R] (rows of slot -1 hold garbage: the
    caller selects by slot)."""
    sp = tl.arange(0, MAX_SPLITS)
    at = (part_ptr + sp[:, None, None].to(tl.int64) * stride_ps
          + rows[None, :, None].to(tl.int64) * stride_pm + rr[None, None, :])
    mask = (sp < num_splits)[:, None, None] & row_ok[None, :, None] & r_ok[None, None, :]
    h = tl.sum(tl.load(at, mask=mask, other=0.0), axis=0)  # one round of loads
    return h


@triton.jit(do_not_specialize=["num_rows", "num_splits", "stride_ps"])
def _lora_expand_kernel(part_ptr, b_ptr, slots_ptr, y_ptr, num_rows, part_rank, num_splits,
                        num_slots, n_end0, n_end1, n_end2, t_end0, t_end1,
                        stride_ps, stride_pm, stride_bs, stride_bn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        MAX_SPLITS: tl.constexpr, WIDE_SLOTS: tl.constexpr,
                        PRECISION: tl.constexpr, PDL: tl.constexpr):
    let_dependents_launch(PDL)
    wait_for_predecessor(PDL)  # the partials, y and the slots are written earlier in the step
    p, col0, part_end = _part_of_tile(tl.program_id(1), n_end0, n_end1, n_end2, t_end0, t_end1,
                                      BLOCK_N)
    cols = col0 + tl.arange(0, BLOCK_N)
    col_ok = cols < part_end
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    slot = tl.load(slots_ptr + rows, mask=row_ok, other=-1)
    mask = (slot >= 0)[:, None] & col_ok[None, :]
    y_at = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
    delta = _delta(part_ptr, b_ptr, slot, rows, row_ok, cols, col_ok, p, part_rank,
                   num_splits, num_slots, stride_ps, stride_pm, stride_bs, stride_bn,
                   BLOCK_M, BLOCK_N, BLOCK_R, MAX_SPLITS, WIDE_SLOTS, PRECISION)
    tl.store(y_at, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_silu_mul(g, u, out_ptr, rows, cols, stride_om, mask):
    """Stores silu(g) * u for the [BLOCK_M, BLOCK_N] tile (g, u fp32: base + delta) with the
    unfused path's rounding: gate and up to the dtype, silu(gate) to the dtype, then the product
    (shard/kernels/elementwise.py silu_mul), so base rows get exactly what silu_mul gives."""
    dtype = out_ptr.dtype.element_ty
    g = g.to(dtype).to(tl.float32)
    u = u.to(dtype).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    out_at = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_at, (a * u).to(dtype), mask=mask)


@triton.jit(do_not_specialize=["num_rows", "num_splits", "stride_ps"])
def _lora_expand_silu_kernel(part_ptr, b_ptr, slots_ptr, y_ptr, out_ptr, num_rows, inter,
                             part_rank, num_splits, num_slots,
                             stride_ps, stride_pm, stride_bs, stride_bn, stride_ym, stride_om,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_R: tl.constexpr, MAX_SPLITS: tl.constexpr,
                             WIDE_SLOTS: tl.constexpr, PRECISION: tl.constexpr,
                             PDL: tl.constexpr):
    let_dependents_launch(PDL)
    wait_for_predecessor(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # gate's; up's are inter + cols
    col_ok = cols < inter
    slot = tl.load(slots_ptr + rows, mask=row_ok, other=-1)
    mask = row_ok[:, None] & col_ok[None, :]
    y_at = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    g = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(y_at + inter, mask=mask, other=0.0).to(tl.float32)
    g += _delta(part_ptr, b_ptr, slot, rows, row_ok, cols, col_ok, 0, part_rank, num_splits,
                num_slots, stride_ps, stride_pm, stride_bs, stride_bn,
                BLOCK_M, BLOCK_N, BLOCK_R, MAX_SPLITS, WIDE_SLOTS, PRECISION)
    u += _delta(part_ptr, b_ptr, slot, rows, row_ok, inter + cols, col_ok, 1, part_rank,
                num_splits, num_slots, stride_ps, stride_pm, stride_bs, stride_bn,
                BLOCK_M, BLOCK_N, BLOCK_R, MAX_SPLITS, WIDE_SLOTS, PRECISION)
    _store_silu_mul(g, u, out_ptr, rows, cols, stride_om, mask)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, part_rank: int,
                max_splits: int | None = None, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x [M, K], a [num_slots, parts * part_rank, K], slots [M] int32 (-1: none) -> the split-K
    partials [splits, M, parts * part_rank] float32 of x @ a[slot]^T per row; rows of slot -1
    are left unwritten (lora_expand_ ignores them). At most `max_splits` splits (default
    MAX_SPLITS): pass the same to the expand. `out`: a float32 buffer to write the partials
    into (its first splits * M * R elements; e.g. one allocated off a side stream)."""
    m, k = x.shape
    num_slots, r, _ = a.shape
    assert r % part_rank == 0, (r, part_rank)
    max_splits = _max_splits(max_splits or MAX_SPLITS, part_rank)
    assert x.stride(1) == 1 and a.stride(2) == 1
    splits, k_per_split = _splits(m, k, r // part_rank, max_splits,
                                  _wide_rank_scaled(SHRINK_BLOCK_K, part_rank))
    if out is None:
        part = torch.empty((splits, m, r), dtype=torch.float32, device=x.device)
    else:
        assert out.dtype == torch.float32 and out.is_contiguous(), (out.dtype, out.stride())
        part = out.view(-1)[: splits * m * r].view(splits, m, r)
    if m == 0:
        return part
    grid = (num_slots, triton.cdiv(m, SHRINK_BLOCK_M), splits * (r // part_rank))
    _lora_shrink_kernel[grid](
        x, a, slots, part, m, k, part_rank, k_per_split, x.stride(0), a.stride(0), a.stride(1),
        part.stride(0), part.stride(1), BLOCK_M=SHRINK_BLOCK_M, BLOCK_R=_block_r(part_rank),
        BLOCK_K=_wide_rank_scaled(SHRINK_BLOCK_K, part_rank), PRECISION=_precision(x.dtype),
        num_warps=SHRINK_NUM_WARPS,
        **pdl.launch_options(x.device),
    )
    return part


def lora_expand_(y: torch.Tensor, part: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                 part_sizes: list[int], part_rank: int, max_splits: int | None = None) -> None:
    """y [M, N] += h @ b[slot]^T per row, in place; h = the sum of lora_shrink's partials
    [splits, M, parts * part_rank]; b [num_slots, N, parts * part_rank] block-diagonal over the
    parts, whose output sizes `part_sizes` sum to N. Rows with slot -1 are left untouched.
    `max_splits`: lora_shrink's (fixed per linear, whatever the batch: one compiled variant)."""
    max_splits = _max_splits(max_splits or MAX_SPLITS, part_rank)
    m, n = y.shape
    num_slots = b.shape[0]
    assert sum(part_sizes) == n and 1 <= len(part_sizes) <= MAX_PARTS, (part_sizes, n)
    assert y.stride(1) == 1 and b.stride(2) == 1 and part.shape[0] <= max_splits
    if m == 0:
        return
    ends = [sum(part_sizes[: i + 1]) for i in range(len(part_sizes))]
    ends += [n] * (MAX_PARTS - len(ends))
    block_n = _wide_rank_scaled(EXPAND_BLOCK_N, part_rank)
    tiles = [triton.cdiv(size, block_n) for size in part_sizes]
    t_ends = [sum(tiles[: i + 1]) for i in range(len(tiles))]
    t_ends += [t_ends[-1]] * (MAX_PARTS - len(t_ends))
    grid = (triton.cdiv(m, EXPAND_BLOCK_M), t_ends[-1])
    _lora_expand_kernel[grid](
        part, b, slots, y, m, part_rank, part.shape[0], num_slots, ends[0], ends[1], ends[2],
        t_ends[0], t_ends[1], part.stride(0), part.stride(1), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=EXPAND_BLOCK_M, BLOCK_N=block_n, BLOCK_R=_block_r(part_rank),
        MAX_SPLITS=triton.next_power_of_2(max_splits),
        WIDE_SLOTS=_wide_slots(num_slots, part_rank),
        PRECISION=_precision(y.dtype), num_warps=EXPAND_NUM_WARPS, **pdl.launch_options(y.device),
    )


def lora_expand_silu_mul(y: torch.Tensor, part: torch.Tensor, b: torch.Tensor,
                         slots: torch.Tensor, part_rank: int, max_splits: int | None = None
                         ) -> torch.Tensor:
    """For gate/up: y [M, 2I] (gate | up, the base output) -> silu(gate') * up' [M, I], where
    gate' | up' = y + each row's LoRA delta (as lora_expand_; b [num_slots, 2I, 2 * part_rank]
    block-diagonal). y is not modified. `max_splits`: lora_shrink's (default SILU_MAX_SPLITS)."""
    max_splits = _max_splits(max_splits or SILU_MAX_SPLITS, part_rank)
    m, n = y.shape
    num_slots = b.shape[0]
    assert n % 2 == 0 and b.shape[2] == 2 * part_rank, (n, b.shape, part_rank)
    assert y.stride(1) == 1 and b.stride(2) == 1 and part.shape[0] <= max_splits
    inter = n // 2
    out = torch.empty((m, inter), dtype=y.dtype, device=y.device)
    if m == 0:
        return out
    block_n = _wide_rank_scaled(SILU_BLOCK_N, part_rank)
    grid = (triton.cdiv(m, EXPAND_BLOCK_M), triton.cdiv(inter, block_n))
    _lora_expand_silu_kernel[grid](
        part, b, slots, y, out, m, inter, part_rank, part.shape[0], num_slots,
        part.stride(0), part.stride(1), b.stride(0), b.stride(1), y.stride(0), out.stride(0),
        BLOCK_M=EXPAND_BLOCK_M, BLOCK_N=block_n, BLOCK_R=_block_r(part_rank),
        MAX_SPLITS=triton.next_power_of_2(max_splits),
        WIDE_SLOTS=_wide_slots(num_slots, part_rank),
        PRECISION=_precision(y.dtype), num_warps=EXPAND_NUM_WARPS, **pdl.launch_options(y.device),
    )
    return out


def _splits(m: int, k: int, rank_blocks: int, max_splits: int, block_k: int
            ) -> tuple[int, int]:
    """(splits, K per split): enough programs per slot to fill the GPU at decode sizes, at most
    max_splits, each split a multiple of block_k and at least SHRINK_MIN_K_PER_SPLIT."""
    tiles = triton.cdiv(max(m, 1), SHRINK_BLOCK_M) * rank_blocks
    want = min(max_splits, triton.cdiv(SHRINK_TARGET_PROGRAMS, tiles),
               max(1, k // SHRINK_MIN_K_PER_SPLIT))
    k_per_split = triton.cdiv(triton.cdiv(k, want), block_k) * block_k
    return triton.cdiv(k, k_per_split), k_per_split


def _max_splits(requested: int, part_rank: int) -> int:
    """Splits at most, for a rank: the expand holds [splits, 64 rows, rank] fp32 partials in
    registers, kept to <= SPLIT_RANKS_MAX (8 splits at rank 16, 1 at rank 128)."""
    return max(1, min(requested, SPLIT_RANKS_MAX // _block_r(part_rank)))


def _wide_rank_scaled(block: int, part_rank: int) -> int:
    """A K or N block for ranks above 32: halved per doubling (registers; ranks <= 32, the
    common case, get the block as is), at least 32."""
    return max(32, block * 32 // max(32, _block_r(part_rank)))


def _fold_block_m(part_rank: int) -> int:
    """The folded expands' row tile: halved for ranks above 64 (the [rows, R] h tiles of the
    slot loop; the SiLU variant holds two)."""
    return FOLD_BLOCK_M if _block_r(part_rank) <= 64 else FOLD_BLOCK_M // 2


def _block_r(part_rank: int) -> int:
    return max(16, triton.next_power_of_2(part_rank))  # tl.dot needs >= 16


def _wide_slots(num_slots: int, part_rank: int) -> int:
    """The expand's one-dot width in slots (a power of two), or 0 (loop over the present
    slots) where all slots' B tiles would not fit one dot's K of WIDE_MAX_K."""
    wide = triton.next_power_of_2(num_slots)
    return wide if wide * _block_r(part_rank) <= WIDE_MAX_K else 0


def _precision(dtype: torch.dtype) -> str:
    # float32 models get exact fp32 products (tf32 would drift from the torch path); for 16-bit
    # operands the precision argument does not apply (bf16 / fp16 tensor-core dots).
    return "ieee" if dtype == torch.float32 else "tf32"


# ---- Folded shrink: every slot's A rides in the base GEMM --------------------------------------
#
# With LoRA on, a 16-bit (or fp32) base linear's weight carries every slot's A as extra rows
# after its N output rows (shard/layers/lora.py LoraWeights.fold_into): [N + slots * parts * R
# (+ pad), K]. The base GEMM then also writes every slot's h = x @ A[slot]^T, rounded to the model
# dtype like peft's lora_A output, into the columns after N of its wide output
#     y_wide [M, N + E]:  y_wide[:, :N] the base output,
#                         y_wide[:, N + s * parts * R + p * R + r] slot s's rank r of part p
# so a LoRA linear needs no shrink launch at all (4 fewer kernels per layer; the GEMM grows by
# E / N: +3 % for q/k/v, +1.6 % o and down, +0.4 % gate/up at 4 slots of rank 16 on
# Llama-3-8B). The expand below reads each row's own slot's R columns of y_wide (zeros for the
# other slots' columns), one dot over all slots as in _delta, and writes base + delta to a NEW
# contiguous [M, N] tensor: the consumers (q/k/v split and views, all-reduce, residual norm) see
# the same tensor as without LoRA. Per program: the y tile, the [rows, slots * R] h tile (bf16,
# no fp32 partials, no split sum) and the B tiles; the B tiles are read before the PDL wait (the
# adapter slots are written between steps, never by a kernel of the step), so they load during
# the base GEMM's tail.

# Block sizes at batch 64 on 132 SMs (registers from ptxas for sm_90, bf16, 4 slots of rank 16):
# the expand's [64, 128] tile takes 142 registers x 256 threads (one program per SM): 32
# programs for o / down, 48 for q/k/v, one wave; the SiLU expand's [64, 128] gate + up tiles
# take 200 registers (no spills): 112 programs for Llama-3-8B's 14336 columns, one wave, where
# [64, 64] tiles (150 registers, still one per SM) would need 224 programs, two waves.
# benchmarks/lora_kernels.py sweeps the alternatives on a GPU.
FOLD_BLOCK_M = 64
FOLD_BLOCK_N = 128
FOLD_SILU_BLOCK_N = 128
FOLD_NUM_WARPS = 8


@triton.jit
def _folded_b(b_ptr, cols, col_ok, p, part_rank, num_slots, stride_bs, stride_bn,
              BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, WIDE_SLOTS: tl.constexpr):
    """All slots' B tiles of part p's ranks, stacked along R: [WIDE_SLOTS * BLOCK_R, BLOCK_N]
    (zeros past num_slots and past the rank)."""
    r_in = tl.arange(0, BLOCK_R)
    rr = p * part_rank + r_in
    s_in = tl.arange(0, WIDE_SLOTS)
    at = (b_ptr + s_in[:, None, None].to(tl.int64) * stride_bs
          + cols[None, None, :].to(tl.int64) * stride_bn + rr[None, :, None])
    mask = ((s_in < num_slots)[:, None, None] & (r_in < part_rank)[None, :, None]
            & col_ok[None, None, :])
    b = tl.load(at, mask=mask, other=0.0)
    return tl.reshape(b, [WIDE_SLOTS * BLOCK_R, BLOCK_N])


@triton.jit
def _folded_delta(y_ptr, b_ptr, b_wide, slot, rows, row_ok, cols, col_ok, p, h_col0,
                  slot_stride, part_rank, num_slots, stride_ym, stride_bs, stride_bn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  WIDE_SLOTS: tl.constexpr, PRECISION: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32: each row's h (part p's ranks of its slot, read from y_wide's
    columns h_col0 + slot * slot_stride + p * part_rank + r) @ its slot's B tile; 0 for rows of
    slot -1. WIDE_SLOTS > 0: one dot against `b_wide` (_folded_b); 0: a loop over the slots
    present (b_wide unused)."""
    y_rows = y_ptr + rows[:, None].to(tl.int64) * stride_ym + h_col0 + p * part_rank
    if WIDE_SLOTS > 0:
        j = tl.arange(0, WIDE_SLOTS * BLOCK_R)
        s_of, r_of = j // BLOCK_R, j % BLOCK_R
        # every slot's h of the rows (a few KB), selected by slot after the load: the load does
        # not wait for the slots' (nor the y tile's), all three are in flight at once
        mask = row_ok[:, None] & ((s_of < num_slots) & (r_of < part_rank))[None, :]
        h = tl.load(y_rows + (s_of * slot_stride + r_of)[None, :], mask=mask, other=0.0)
        h = tl.where(slot[:, None] == s_of[None, :], h, 0.0)
        acc = tl.dot(h.to(b_wide.dtype), b_wide, input_precision=PRECISION)
    else:
        r_in = tl.arange(0, BLOCK_R)
        r_ok = r_in < part_rank
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        b_tile = (b_ptr + cols[None, :].to(tl.int64) * stride_bn
                  + (p * part_rank + r_in)[:, None])  # [BLOCK_R, BLOCK_N]
        for s in range(num_slots):
            sel = row_ok & (slot == s)
            if tl.max(sel.to(tl.int32), axis=0) > 0:
                b = tl.load(b_tile + s * stride_bs, mask=r_ok[:, None] & col_ok[None, :],
                            other=0.0)
                h = tl.load(y_rows + s * slot_stride + r_in[None, :],
                            mask=sel[:, None] & r_ok[None, :], other=0.0)
                acc += tl.dot(h.to(b.dtype), b, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["num_rows"])
def _lora_expand_folded_kernel(y_ptr, b_ptr, slots_ptr, out_ptr, num_rows, h_col0, slot_stride,
                               part_rank, num_slots, n_end0, n_end1, n_end2, t_end0, t_end1,
                               stride_ym, stride_bs, stride_bn, stride_om,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_R: tl.constexpr, WIDE_SLOTS: tl.constexpr,
                               PRECISION: tl.constexpr, PDL: tl.constexpr):
    let_dependents_launch(PDL)
    p, col0, part_end = _part_of_tile(tl.program_id(1), n_end0, n_end1, n_end2, t_end0, t_end1,
                                      BLOCK_N)
    cols = col0 + tl.arange(0, BLOCK_N)
    col_ok = cols < part_end
    b_wide = tl.zeros([16, BLOCK_N], dtype=tl.float32)  # (unused in the slot loop)
    if WIDE_SLOTS > 0:  # adapter weights: never written by the step's kernels
        b_wide = _folded_b(b_ptr, cols, col_ok, p, part_rank, num_slots, stride_bs, stride_bn,
                           BLOCK_N, BLOCK_R, WIDE_SLOTS)
    wait_for_predecessor(PDL)  # y_wide (the base GEMM) and the slots
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    slot = tl.load(slots_ptr + rows, mask=row_ok, other=-1)
    mask = row_ok[:, None] & col_ok[None, :]
    y = tl.load(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    y += _folded_delta(y_ptr, b_ptr, b_wide, slot, rows, row_ok, cols, col_ok, p, h_col0,
                       slot_stride, part_rank, num_slots, stride_ym, stride_bs, stride_bn,
                       BLOCK_M, BLOCK_N, BLOCK_R, WIDE_SLOTS, PRECISION)
    out_at = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_at, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def _lora_expand_folded_silu_kernel(y_ptr, b_ptr, slots_ptr, out_ptr, num_rows, inter,
                                    h_col0, slot_stride, part_rank, num_slots,
                                    stride_ym, stride_bs, stride_bn, stride_om,
                                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                    BLOCK_R: tl.constexpr, WIDE_SLOTS: tl.constexpr,
                                    PRECISION: tl.constexpr, PDL: tl.constexpr):
    let_dependents_launch(PDL)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # gate's; up's are inter + cols
    col_ok = cols < inter
    bg = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    bu = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    if WIDE_SLOTS > 0:
        bg = _folded_b(b_ptr, cols, col_ok, 0, part_rank, num_slots, stride_bs, stride_bn,
                       BLOCK_N, BLOCK_R, WIDE_SLOTS)
        bu = _folded_b(b_ptr, inter + cols, col_ok, 1, part_rank, num_slots, stride_bs,
                       stride_bn, BLOCK_N, BLOCK_R, WIDE_SLOTS)
    wait_for_predecessor(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    slot = tl.load(slots_ptr + rows, mask=row_ok, other=-1)
    mask = row_ok[:, None] & col_ok[None, :]
    y_at = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    g = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(y_at + inter, mask=mask, other=0.0).to(tl.float32)
    g += _folded_delta(y_ptr, b_ptr, bg, slot, rows, row_ok, cols, col_ok, 0, h_col0,
                       slot_stride, part_rank, num_slots, stride_ym, stride_bs, stride_bn,
                       BLOCK_M, BLOCK_N, BLOCK_R, WIDE_SLOTS, PRECISION)
    u += _folded_delta(y_ptr, b_ptr, bu, slot, rows, row_ok, inter + cols, col_ok, 1, h_col0,
                       slot_stride, part_rank, num_slots, stride_ym, stride_bs, stride_bn,
                       BLOCK_M, BLOCK_N, BLOCK_R, WIDE_SLOTS, PRECISION)
    _store_silu_mul(g, u, out_ptr, rows, cols, stride_om, mask)


def lora_expand_folded(y_wide: torch.Tensor, n: int, b: torch.Tensor, slots: torch.Tensor,
                       part_sizes: list[int], part_rank: int) -> torch.Tensor:
    """y_wide [M, n + E]: a folded base GEMM's output (the base output in [:, :n], every slot's
    h after it, see above) -> [M, n] contiguous: base + each row's h @ b[slot]^T (b [num_slots,
    n, parts * part_rank] block-diagonal over the parts of `part_sizes`); rows of slot -1 get
    the base output unchanged."""
    m = y_wide.shape[0]
    num_slots, _, ranks = b.shape
    assert sum(part_sizes) == n and 1 <= len(part_sizes) <= MAX_PARTS, (part_sizes, n)
    assert ranks == len(part_sizes) * part_rank and y_wide.shape[1] >= n + num_slots * ranks
    assert y_wide.stride(1) == 1 and b.stride(2) == 1
    out = torch.empty((m, n), dtype=y_wide.dtype, device=y_wide.device)
    if m == 0:
        return out
    ends = [sum(part_sizes[: i + 1]) for i in range(len(part_sizes))]
    ends += [n] * (MAX_PARTS - len(ends))
    block_n = _wide_rank_scaled(FOLD_BLOCK_N, part_rank)
    tiles = [triton.cdiv(size, block_n) for size in part_sizes]
    t_ends = [sum(tiles[: i + 1]) for i in range(len(tiles))]
    t_ends += [t_ends[-1]] * (MAX_PARTS - len(t_ends))
    grid = (triton.cdiv(m, _fold_block_m(part_rank)), t_ends[-1])
    _lora_expand_folded_kernel[grid](
        y_wide, b, slots, out, m, n, ranks, part_rank, num_slots, ends[0], ends[1], ends[2],
        t_ends[0], t_ends[1], y_wide.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_M=_fold_block_m(part_rank), BLOCK_N=block_n, BLOCK_R=_block_r(part_rank),
        WIDE_SLOTS=_wide_slots(num_slots, part_rank), PRECISION=_precision(y_wide.dtype),
        num_warps=FOLD_NUM_WARPS, **pdl.launch_options(y_wide.device),
    )
    return out


def lora_expand_folded_silu_mul(y_wide: torch.Tensor, n: int, b: torch.Tensor,
                                slots: torch.Tensor, part_rank: int) -> torch.Tensor:
    """For gate/up: y_wide [M, n + E] (gate | up | every slot's h) -> silu(gate') * up' [M, n/2]
    where gate' | up' = the base output + each row's LoRA delta (b [num_slots, n, 2 * part_rank]
    block-diagonal)."""
    m = y_wide.shape[0]
    num_slots, _, ranks = b.shape
    assert n % 2 == 0 and ranks == 2 * part_rank and y_wide.shape[1] >= n + num_slots * ranks
    assert y_wide.stride(1) == 1 and b.stride(2) == 1
    inter = n // 2
    out = torch.empty((m, inter), dtype=y_wide.dtype, device=y_wide.device)
    if m == 0:
        return out
    block_n = _wide_rank_scaled(FOLD_SILU_BLOCK_N, part_rank)
    grid = (triton.cdiv(m, _fold_block_m(part_rank)), triton.cdiv(inter, block_n))
    _lora_expand_folded_silu_kernel[grid](
        y_wide, b, slots, out, m, inter, n, ranks, part_rank, num_slots,
        y_wide.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_M=_fold_block_m(part_rank), BLOCK_N=block_n, BLOCK_R=_block_r(part_rank),
        WIDE_SLOTS=_wide_slots(num_slots, part_rank), PRECISION=_precision(y_wide.dtype),
        num_warps=FOLD_NUM_WARPS, **pdl.launch_options(y_wide.device),
    )
    return out
