"""LoRA on the tensor-parallel linears: stacked per-slot adapter weights and their batched
application, every row of a step with its own adapter (or none).

One `LoraWeights` hangs on each adapted linear (`MergedColumnParallelLinear` for q/k/v and
gate/up, `RowParallelLinear` for o and down). Its buffers hold every resident adapter, one slot
each, at fixed addresses (captured CUDA graphs read them), plus a last all-zero slot:
    a [slots + 1, parts * R, in_local]    the parts' A matrices stacked along the rank axis
    b [slots + 1, out_local, parts * R]   block-diagonal: part p's rows read only part p's ranks;
                                          the scaling (alpha / r, or alpha / sqrt(r)) folded in
so that one shrink and one expand serve q/k/v (or gate/up) together. Where the base linear has
a plain weight of the adapters' dtype (not quantized), `fold_into` moves `a` (minus the zero
slot) into extra rows of that weight: the base GEMM then computes every slot's x @ A^T with the
base output and only the expand remains (`expand_folded`, `silu_mul_folded`); quantized bases
keep the separate shrink (`apply_`, `silu_mul`). Under tensor parallelism a
column-parallel layer holds B's rows of its output slice; a row-parallel one A's columns of its
input slice, and its share (x_rank A_rank^T) B^T is summed over ranks by the layer's own
all-reduce, like the base output.

`LoraBatch` is the step's state, shared by every LoraWeights of a model: which slot each token
row uses. The runner sets it before each forward (`ModelRunner.prepare`, or the CUDA-graph
runner's static slot buffer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# CPU steps of at most this many token rows over several adapters gather each row's A and B
# (rows x rank x features floats each) instead of one matmul pair per adapter.
GATHER_MAX_ROWS = 64


@dataclass
class LoraBatch:
    """Per-step adapter slots of the token rows. `active` is False when no row of the step has
    an adapter (the base path runs untouched)."""

    num_slots: int  # resident adapter slots (--max-loras)
    active: bool = False
    # [num_tokens] int32 slot of each token row (-1: base model); on the model's device.
    token_slots: torch.Tensor | None = None
    # CPU path, large steps (prefill): (slot, row indices [rows] int64 or None for "every
    # row") per slot present: one pair of matmuls per adapter.
    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    # CPU path, small steps (decode): [num_tokens] int64 slot per row, base rows on the zero
    # slot: every row gathers its own A and B and one bmm pair serves all adapters at once.
    gather: torch.Tensor | None = None

    def set_rows(self, token_slots: list[int], device: torch.device) -> None:
        """The step's slot per token row (host list), or all -1."""
        present = sorted({s for s in token_slots if s >= 0})
        self.active = bool(present)
        self.groups, self.gather = [], None
        if not self.active:
            self.token_slots = None
            return
        slots = torch.tensor(token_slots, dtype=torch.int32)
        self.token_slots = slots.to(device, non_blocking=True)
        if device.type == "cuda":
            return
        if len(present) == 1 and all(s == present[0] for s in token_slots):
            self.groups = [(present[0], None)]
        elif len(token_slots) <= GATHER_MAX_ROWS:
            self.gather = torch.where(slots < 0, self.num_slots, slots).long()
        else:
            self.groups = [(s, torch.nonzero(slots == s).flatten()) for s in present]

    def set_device_rows(self, token_slots: torch.Tensor) -> None:
        """CUDA graphs: the slots live in a static buffer the graph reads ([rows] int32)."""
        self.active = True
        self.token_slots = token_slots
        self.groups = []
        self.gather = None

    def clear(self) -> None:
        self.active = False
        self.token_slots = None
        self.groups = []
        self.gather = None


@dataclass(frozen=True)
class LoraPart:
    """One adapted projection inside a LoraWeights: its checkpoint module name and full shape
    (what an adapter's tensors must match), and this rank's slice of it."""

    name: str  # checkpoint module name, e.g. "model.layers.0.self_attn.q_proj"
    in_features: int  # full (all ranks)
    out_features: int
    in_slice: tuple[int, int]  # [start, stop) of A's columns this rank holds
    out_slice: tuple[int, int]  # [start, stop) of B's rows this rank holds
    out_offset: int  # first row of this part in the merged local output


class LoraWeights:
    """The stacked adapter weights of one linear layer (one or more parts) and their batched
    application to that layer's output."""

    def __init__(self, parts: list[LoraPart], batch: LoraBatch, max_rank: int,
                 device: torch.device, dtype: torch.dtype):
        self.parts = parts
        self.batch = batch
        self.max_rank = max_rank
        in_local = parts[0].in_slice[1] - parts[0].in_slice[0]
        out_local = sum(p.out_slice[1] - p.out_slice[0] for p in parts)
        ranks = len(parts) * max_rank
        # output features of each part in the merged local output (the expand's column tiles
        # stay inside one part and read only its ranks of the block-diagonal B)
        self.part_sizes = [p.out_slice[1] - p.out_slice[0] for p in parts]
        slots = batch.num_slots + 1  # the last one stays zero (CPU gathers of "no adapter")
        self.a = torch.zeros((slots, ranks, in_local), dtype=dtype, device=device)
        self.b = torch.zeros((slots, out_local, ranks), dtype=dtype, device=device)
        # fold_into: the base output features N; then `a` is [slots, parts * R, in_local], rows
        # of the base linear's widened weight (no zero slot), and the base GEMM computes h.
        self.folded: int | None = None

    def fold_into(self, weight: torch.Tensor) -> torch.Tensor | None:
        """Widens a base linear's weight [N, in_local] (16-bit or fp32, the adapters' dtype)
        to [N + E, in_local]: rows N + s * parts * R + p * R + r hold slot s's A (part p, rank
        r; E rounded up to 16 rows, the extra ones zero), so that x @ wide^T yields the base
        output AND every slot's h = x @ A[s]^T in one GEMM (shard/kernels/lora.py, "Folded
        shrink"). Returns the wide weight (the caller makes its weight the view wide[:N]), or
        None where the weight cannot carry them (other dtype / device, not contiguous). `a`
        becomes the view of the extra rows: write_slot fills them in place."""
        n, k = weight.shape
        slots, ranks = self.batch.num_slots, len(self.parts) * self.max_rank
        if (weight.dtype != self.a.dtype or weight.device != self.a.device
                or not weight.is_contiguous() or k != self.a.shape[2]
                or n != sum(self.part_sizes)):
            return None
        extra = -(-slots * ranks // 16) * 16
        wide = torch.zeros((n + extra, k), dtype=weight.dtype, device=weight.device)
        wide[:n].copy_(weight)
        self.a = wide[n : n + slots * ranks].view(slots, ranks, k)
        self.folded = n
        return wide

    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()

    def write_slot(self, slot: int, tensors: list[tuple[torch.Tensor, torch.Tensor] | None]
                   ) -> None:
        """Fills `slot` from host tensors, per part (A [r, in_local], B [out_local, r] already
        scaled) or None where the adapter leaves the part alone. Everything else in the slot is
        zeroed: a smaller rank, or an absent part, contributes nothing."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        r_max = self.max_rank
        for p, (part, ab) in enumerate(zip(self.parts, tensors)):
            if ab is None:
                continue
            a, b = ab
            r = a.shape[0]
            rows = part.out_offset, part.out_offset + b.shape[0]
            self.a[slot, p * r_max : p * r_max + r].copy_(a, non_blocking=True)
            self.b[slot, rows[0] : rows[1], p * r_max : p * r_max + r].copy_(b, non_blocking=True)

    def expand_folded(self, y_wide: torch.Tensor) -> torch.Tensor:
        """Folded linears (fold_into): y_wide [n, N + E], the widened weight's output -> [n, N]
        contiguous, the base output plus each row's LoRA delta (a new tensor; y_wide is not
        modified)."""
        n = self.folded
        assert n is not None
        if y_wide.is_cuda:
            from shard.kernels.lora import lora_expand_folded

            slots, resident = self.batch.token_slots, self.batch.num_slots
            assert slots is not None
            return lora_expand_folded(y_wide, n, self.b[:resident], slots, self.part_sizes,
                                      self.max_rank)
        out = y_wide[:, :n].contiguous()
        self._add_folded_delta(y_wide, out)
        return out

    def silu_mul_folded(self, y_wide: torch.Tensor) -> torch.Tensor:
        """For gate/up, folded: silu(gate') * up' [n, N / 2] of y_wide [n, N + E], gate' | up'
        the base output plus each row's LoRA delta (CUDA: one kernel, which replaces the base
        path's SiLU-and-mul)."""
        assert len(self.parts) == 2 and self.part_sizes[0] == self.part_sizes[1]
        n = self.folded
        assert n is not None
        if y_wide.is_cuda:
            from shard.kernels.lora import lora_expand_folded_silu_mul

            slots, resident = self.batch.token_slots, self.batch.num_slots
            assert slots is not None
            return lora_expand_folded_silu_mul(y_wide, n, self.b[:resident], slots,
                                               self.max_rank)
        gate, up = self.expand_folded(y_wide).split(self.part_sizes, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def _add_folded_delta(self, y_wide: torch.Tensor, out: torch.Tensor) -> None:
        """CPU: out [n, N] += each row's h (from y_wide's extra columns) @ B[slot]^T."""
        n, batch, slots = self.folded, self.batch, self.batch.num_slots
        assert n is not None
        ranks = len(self.parts) * self.max_rank
        h = y_wide[:, n : n + slots * ranks].unflatten(1, (slots, ranks))  # [rows, slots, PR]
        if batch.gather is not None:  # base rows: gather index `slots`, B's zero slot
            rows = torch.arange(h.shape[0])
            h_row = h[rows, batch.gather.clamp(max=slots - 1)]  # [rows, PR]
            b = self.b.index_select(0, batch.gather)  # [rows, N, PR]
            out += torch.bmm(b, h_row.unsqueeze(2)).squeeze(2)
            return
        for slot, rows in batch.groups:
            if rows is None:
                out += h[:, slot] @ self.b[slot].T
            else:
                out.index_add_(0, rows, h[rows, slot] @ self.b[slot].T)

    def silu_mul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """For gate/up (two parts of equal size): silu(gate) * up [n, I] of y [n, 2I] (the base
        output) plus each row's LoRA delta. CUDA: one fused expand, which replaces the separate
        SiLU-and-mul kernel; y is not modified there (it is on CPU)."""
        assert len(self.parts) == 2 and self.part_sizes[0] == self.part_sizes[1]
        if x.is_cuda:
            from shard.kernels.lora import SILU_MAX_SPLITS, lora_expand_silu_mul, lora_shrink

            slots, resident = self.batch.token_slots, self.batch.num_slots
            assert slots is not None
            part = lora_shrink(x, self.a[:resident], slots, self.max_rank, SILU_MAX_SPLITS)
            return lora_expand_silu_mul(y, part, self.b[:resident], slots, self.max_rank,
                                        SILU_MAX_SPLITS)
        self.apply_(x, y)
        gate, up = y.split(self.part_sizes, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def apply_(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [n, out_local] += the LoRA delta of each row of x [n, in_local], in place."""
        batch = self.batch
        if x.is_cuda:
            from shard.kernels.lora import lora_expand_, lora_shrink

            slots, resident = batch.token_slots, batch.num_slots
            assert slots is not None
            # [splits, n, parts * R] float32 split-K partials of x @ A[slot]^T
            part = lora_shrink(x, self.a[:resident], slots, self.max_rank)
            lora_expand_(y, part, self.b[:resident], slots, self.part_sizes, self.max_rank)
            return
        if batch.gather is not None:
            a = self.a.index_select(0, batch.gather)  # [n, parts * R, in]
            b = self.b.index_select(0, batch.gather)  # [n, out, parts * R]
            h = torch.bmm(a, x.unsqueeze(2))  # [n, parts * R, 1]
            y += torch.bmm(b, h).squeeze(2)
            return
        for slot, rows in batch.groups:
            a, b = self.a[slot], self.b[slot]  # [parts * R, in], [out, parts * R]
            if rows is None:
                y += (x @ a.T) @ b.T
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
