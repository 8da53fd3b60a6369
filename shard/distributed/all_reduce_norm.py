"""All-reduce + residual add + RMSNorm in one kernel, for decode-sized tensor-parallel steps: the
collective (symmetric-memory buffer rendezvous, call order, start-up self-check). The exchange
protocol and its kernels are described and implemented in shard/kernels/all_reduce_norm.py.

Why: in a tensor-parallel layer every row-parallel output (o_proj, down_proj) is summed over ranks
and then immediately added to the residual stream and RMS-normalized for the next projection. As
separate kernels that is an all-reduce (~7 us for [1, 4096] bf16 on 2 H200s even as PyTorch's
one-shot symmetric-memory kernel, whose two barriers are NVLink round trips) plus a fused
add+norm (~2 us), 64 times per Llama-3-8B step: ~0.6 ms of a ~3.5 ms TP=2 batch-1 step
(benchmarks/QUANT_TP.md). The fused kernel does all three with no barrier at all: 5.4 us at
[1, 4096] bf16 on 2 H200s (6.3 us at 8 rows).

A wait that never ends (a dead peer) is cut off after SPIN_LIMIT polls and recorded in the state
(`failed()`); the start-up self-check (`try_all_reduce_add_rms_norm`) uses that to fall back to the
unfused path instead of hanging. Imported only on CUDA (Triton).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from shard.distributed.all_reduce import every_rank_passed
from shard.kernels.all_reduce_norm import EMPTY, SLOTS, STATE_WORDS, all_reduce_add_rms_norm
from shard.kernels.elementwise import add_rms_norm

log = logging.getLogger(__name__)


class AllReduceAddRmsNorm:
    """(rms_norm(x + sum over ranks of partial) * w, x + sum over ranks of partial) in one kernel,
    for [rows <= max_rows, hidden <= max_hidden] bf16/fp16 tensors. Collective: every rank
    constructs it (the buffer rendezvous) and calls it with the same shapes in the same order."""

    def __init__(
        self,
        device: torch.device,
        rank: int,
        world_size: int,
        max_rows: int = 16,
        max_hidden: int = 8192,
    ):
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.world_size = rank, world_size
        self.max_rows, self.max_hidden = max_rows, max_hidden
        group_name = dist.group.WORLD.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by torch < 2.9, a no-op or absent later
            enable(group_name)
        # [3, world, max_rows, max_hidden] int16, 3 MiB for 2 ranks at the defaults.
        words = SLOTS * world_size * max_rows * max_hidden
        self.buffer = symm_mem.empty(words, dtype=torch.int16, device=device)
        handle = symm_mem.rendezvous(self.buffer, group_name)
        self.buffer.fill_(EMPTY.value)
        # Peers' buffers as mapped into this process: [world] int64 device addresses.
        self.buffer_ptrs = torch.tensor(
            [int(p) for p in handle.buffer_ptrs], dtype=torch.int64, device=device
        )
        self.state = torch.zeros(STATE_WORDS, dtype=torch.int32, device=device)
        # Warps per row program; None: add_rms_norm's choice (8 from 4096 columns). That is
        # also the fastest measured on 2 H200s ([1..16, 4096] bf16: 1 warp 12.0-12.6 us, 2
        # 7.1-7.7, 4 6.0-6.6, 8 5.8-6.2; benchmarks/harness/tp.py sweeps it), and the same reduction layout
        # keeps rstd bit-identical to the unfused path's (with 4 warps one element in ~10^6
        # came out one bf16 ulp apart).
        self.num_warps: int | None = None
        # Whether producers may push their output into the buffers themselves (the GEMV's PUSH
        # epilogue, RowParallelLinear.partial); benchmarks turn it off to compare.
        self.accept_pushes = True
        torch.cuda.synchronize(device)
        dist.barrier()  # every buffer holds the mark before anyone pushes

    def handles_rows(self, rows: int, hidden: int, dtype: torch.dtype) -> bool:
        """Whether a [rows, hidden] output of `dtype` can go through the exchange."""
        return (
            dtype in (torch.bfloat16, torch.float16)
            and 1 <= rows <= self.max_rows
            and hidden <= self.max_hidden
        )

    def handles(self, partial: torch.Tensor) -> bool:
        return (
            partial.is_cuda
            and partial.dim() == 2
            and self.handles_rows(partial.shape[0], partial.shape[1], partial.dtype)
            and partial.stride(1) == 1
        )

    def __call__(
        self,
        partial: torch.Tensor,  # [rows, hidden] this rank's row-parallel output, not reduced
        x: torch.Tensor,  # [rows, hidden] residual stream
        weight: torch.Tensor,  # [hidden]
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (normed [rows, hidden], new residual [rows, hidden]), x's dtype."""
        return self._launch(partial, x, weight, eps)

    def reduce_pushed(
        self,
        x: torch.Tensor,  # [rows, hidden] residual stream
        weight: torch.Tensor,  # [hidden]
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As __call__ for a partial that this call's producer already pushed into every rank's
        buffer (a GEMV with the PUSH epilogue, given `exchange_args()`), of x's shape."""
        return self._launch(None, x, weight, eps)

    def exchange_args(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
        """(buffer pointers, state, constexprs) a producer kernel needs to call
        push_to_exchange for this rank."""
        return self.buffer_ptrs, self.state, {
            "RANK": self.rank, "WORLD": self.world_size, "MAX_ROWS": self.max_rows,
            "MAX_HIDDEN": self.max_hidden,
        }

    def _launch(
        self, partial: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ptrs, state, consts = self.exchange_args()
        return all_reduce_add_rms_norm(partial, x, weight, eps, ptrs, state, consts,
                                       self.num_warps)

    def failed(self) -> bool:
        """True once a wait was cut off (host sync: for checks, not the hot path)."""
        return bool(self.state[4].item())


def _reference(
    partial: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused path: NCCL all-reduce, then the fused add + norm kernel."""
    total = partial.clone()
    dist.all_reduce(total)
    return add_rms_norm(total, x, weight, eps)


def try_all_reduce_add_rms_norm(
    device: torch.device, rank: int, world_size: int
) -> AllReduceAddRmsNorm | None:
    """Builds the fused kernel and checks it against the unfused path on every rank (several
    calls of 1-3 rows, so every slot is written, read and reset); None (callers use the unfused
    path) where it is unavailable or wrong. Collective: all ranks call it."""
    fused: AllReduceAddRmsNorm | None = None
    reason = ""
    try:
        fused = AllReduceAddRmsNorm(device, rank, world_size)
        gen = torch.Generator(device=device).manual_seed(1234 + rank)
        weight = torch.rand(4096, generator=gen, device=device).to(torch.bfloat16) + 0.5
        for call, rows in enumerate((1, 3, 2, 1, 1, 2, 3)):
            partial = torch.randn(rows, 4096, generator=gen, device=device).to(torch.bfloat16)
            if call == 0:
                partial[0, :7] = -0.0  # real -0.0 data must not read as "not written"
            x = torch.randn(rows, 4096, device=device).to(torch.bfloat16)
            dist.broadcast(x, 0)  # the residual stream is replicated
            got = fused(partial, x, weight, 1e-5)
            want = _reference(partial, x, weight, 1e-5)
            if fused.failed():
                reason = f"call {call}: a wait timed out"
                break
            # Two ranks: both paths round the exact fp32 sum once, so they agree bit for bit;
            # more ranks add in another order than NCCL's ring.
            tol = 0.0 if world_size == 2 else 2e-2
            if any((g.float() - w.float()).abs().max().item() > tol for g, w in zip(got, want)):
                reason = f"call {call} ({rows} rows) differs from all-reduce + add_rms_norm"
                break
    except Exception as exc:  # noqa: BLE001 - any failure means "use the unfused path"
        reason = f"{type(exc).__name__}: {exc}"
    if not every_rank_passed(reason, device):
        log.warning("fused all-reduce + RMSNorm unavailable (%s); using the unfused path",
                    reason or "failed on another rank")
        return None
    log.info("fused all-reduce + add + RMSNorm for up to %d rows of hidden <= %d",
             fused.max_rows, fused.max_hidden)
    return fused
