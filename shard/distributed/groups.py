"""Tensor-parallel process group: who this rank is and the two collectives the layers need.

One `Dist` object is created at start-up (from CLI flags, never from import-time state) and handed
to every tensor-parallel layer. With world_size 1 the collectives are no-ops, so single-shard code
paths carry no torch.distributed dependency.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from shard.distributed.all_reduce import SymmetricMemoryAllReduce
    from shard.distributed.all_reduce_norm import AllReduceAddRmsNorm


ALL_REDUCE_CHOICES = ("auto", "nccl")


@dataclass(frozen=True)
class Dist:
    """This rank's place in the tensor-parallel group."""

    rank: int = 0
    world_size: int = 1
    # One-shot all-reduce for small CUDA tensors (decode steps); None: NCCL/gloo for every size.
    small_all_reduce: SymmetricMemoryAllReduce | None = field(
        default=None, compare=False, repr=False
    )
    # All-reduce + residual add + RMSNorm in one kernel for decode-sized CUDA tensors
    # (layers.reduce_add_rms_norm); None: the all-reduce, then the add + norm.
    fused_all_reduce_norm: AllReduceAddRmsNorm | None = field(
        default=None, compare=False, repr=False
    )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over ranks; returns the sum (x itself, summed in place, or a new tensor)."""
        if self.world_size == 1:
            return x
        if self.small_all_reduce is not None and self.small_all_reduce.handles(x):
            return self.small_all_reduce(x)
        dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's x along the last dim, rank order (equal shapes)."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest value over ranks (KV cache sizes must agree)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device: torch.device,
    timeout_s: float = 600.0,
    all_reduce: str = "auto",
) -> Dist:
    """Joins the group (gloo on CPU, nccl on CUDA) at tcp://master_addr:master_port.

    all_reduce: "auto" adds, on CUDA where they work, the one-shot symmetric-memory all-reduce
    for small tensors (shard.distributed.all_reduce) and the fused all-reduce + add + RMSNorm for decode-sized
    ones (shard.distributed.all_reduce_norm); "nccl" uses the process group for every size.
    """
    if all_reduce not in ALL_REDUCE_CHOICES:
        raise ValueError(f"--all-reduce must be one of {ALL_REDUCE_CHOICES}; got {all_reduce!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"--rank must be in [0, --world-size); got {rank} of {world_size}")
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        if backend == "nccl" and all_reduce == "auto":
            from shard.distributed.all_reduce import try_symmetric_memory_all_reduce
            from shard.distributed.all_reduce_norm import try_all_reduce_add_rms_norm

            small = try_symmetric_memory_all_reduce(device, rank, world_size)
            fused = try_all_reduce_add_rms_norm(device, rank, world_size)
            return Dist(rank=rank, world_size=world_size, small_all_reduce=small,
                        fused_all_reduce_norm=fused)
    return Dist(rank=rank, world_size=world_size)


def shutdown_distributed(timeout_s: float | None = None) -> bool:
    """Destroys the process group; True once done. With `timeout_s` the teardown runs on a daemon
    thread and is given up after that long (False): NCCL's destroy can wait on peers and on
    outstanding work, and a stopping deployment must not wait on a rank that is already going
    away (a 4-GPU shard took the launcher's whole 30 s stop allowance and was killed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    if timeout_s is None:
        dist.destroy_process_group()
        return True
    worker = threading.Thread(target=dist.destroy_process_group, name="pg-teardown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return not worker.is_alive()
