"""Programmatic dependent launch (Hopper+): let a decode GEMV start while the kernel before it
still runs, so that it can request its weight into L2 during that kernel's idle memory time.

Protocol (CUDA "PDL"): a kernel launched with the PDL attribute may begin once every block of
the kernel before it has executed `griddepcontrol.launch_dependents` (or exited); it must
execute `griddepcontrol.wait` before reading anything that kernel writes. Here the GEMVs
(shard/triton_gemv.py) are the dependents: they prefetch their weight rows, then wait. The
kernels that precede them in a decode step (the fused all-reduce + norm, the add + norm, the
attention merge) trigger at their start: their own work is latency-bound, so the weight bytes
flow while they run. Kernels that never trigger simply let the GEMV start when they finish.

Both instructions need sm_90; `enabled` says whether to compile them in (a constexpr flag of
each kernel), so older GPUs run the same kernels without them.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _enabled(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` use programmatic dependent launch."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _enabled(index)
