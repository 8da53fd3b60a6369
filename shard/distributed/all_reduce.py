"""Low-latency all-reduce for small tensors over peer-mapped GPU memory (torch symmetric memory).

Why: a tensor-parallel decode step issues two all-reduces per layer (attention output and MLP
output), 64 for a 32-layer model, each of only [batch, hidden] (8 KiB at batch 1). NCCL's ring
all-reduce costs ~12-16 us each inside a CUDA graph on 2 H200s (measured, benchmarks/QUANT_TP.md),
~1 ms per step, about a third of a TP=2 batch-1 step. A one-shot all-reduce is one kernel: every
rank writes its input into a buffer that all peers have mapped (NVLink/P2P), one barrier, then every
rank reads all peers' buffers and sums them itself. For small messages that is latency-bound, not
bandwidth-bound, and saves NCCL's protocol steps.

The kernel is PyTorch's own (`torch.ops.symm_mem.one_shot_all_reduce_copy_out`); this module owns
the buffer, the size cutoff (larger tensors, e.g. prefill, go to NCCL where bandwidth matters) and
a start-up self-check: any failure (no P2P, an older torch, a wrong sum) falls back to NCCL with a
log line, never a crash. NVLink multicast (multimem) is deliberately not used.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Largest message sent over symmetric memory: a decode batch of 128 at hidden 4096 in bf16. Above
# this the one-shot's "every rank reads every peer's whole buffer" traffic loses to NCCL's ring.
DEFAULT_MAX_BYTES = 1 << 20


class SymmetricMemoryAllReduce:
    """Sums small CUDA tensors over the default process group via a one-shot kernel.

    Every rank must call `__call__` with the same shapes in the same order (as with NCCL), and
    every rank decides the path from the tensor size alone, so ranks never mix paths.
    """

    def __init__(self, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        self.max_bytes = max_bytes
        self.group_name = dist.group.WORLD.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by torch < 2.9, a no-op or absent later
            enable(self.group_name)
        # One byte buffer, viewed as the caller's dtype: [max_bytes] uint8 on this rank's GPU,
        # mapped into every peer's address space by the (collective) rendezvous.
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        # torch >= 2.9 copies the input into the buffer inside the reduce kernel (one launch);
        # older versions need a separate copy first.
        self.fused_copy = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")

    def handles(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..] on this rank -> a new tensor [..] holding the sum over ranks."""
        n_bytes = x.numel() * x.element_size()
        staging = self.buffer[:n_bytes].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        if self.fused_copy:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(
                staging, x.contiguous(), "sum", self.group_name, out
            )
        else:
            staging.copy_(x)
            torch.ops.symm_mem.one_shot_all_reduce_out(staging, "sum", self.group_name, out)
        return out


def try_symmetric_memory_all_reduce(
    device: torch.device, rank: int, world_size: int, max_bytes: int = DEFAULT_MAX_BYTES
) -> SymmetricMemoryAllReduce | None:
    """Builds the one-shot all-reduce and checks one sum on every rank; returns None (callers
    use NCCL) where it is unavailable or wrong. Collective: all ranks call it. A rank that fails
    before the buffer rendezvous leaves its peers waiting there until the process-group timeout;
    identical ranks (same torch, same GPUs) fail alike, before it."""
    reducer: SymmetricMemoryAllReduce | None = None
    reason = ""
    try:
        reducer = SymmetricMemoryAllReduce(device, max_bytes)
        # Distinct values per rank and per element, exact in bf16: sum_r (r + 1) * (i % 7).
        probe = (torch.arange(4096, device=device) % 7).to(torch.bfloat16) * (rank + 1)
        got = reducer(probe.view(1, -1))
        expected = (torch.arange(4096, device=device) % 7).to(torch.bfloat16) * (
            world_size * (world_size + 1) // 2
        )
        if not torch.equal(got.view(-1), expected):
            reason = "self-check sum differs from the expected value"
    except Exception as exc:  # noqa: BLE001 - any failure means "use NCCL"
        reason = f"{type(exc).__name__}: {exc}"
    if not every_rank_passed(reason, device):
        log.warning("symmetric-memory all-reduce unavailable (%s); using NCCL for all sizes",
                    reason or "failed on another rank")
        return None
    log.info("one-shot symmetric-memory all-reduce for messages up to %d bytes", max_bytes)
    return reducer


def every_rank_passed(reason: str, device: torch.device) -> bool:
    """A start-up check's vote (collective): True when no rank has a failure `reason`, so that
    all ranks take the same path."""
    ok = torch.tensor([0.0 if reason else 1.0], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return ok.item() == 1
