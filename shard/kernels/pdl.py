"""Programmatic dependent launch (PDL, Hopper+) for the decode step's Triton kernels.

Why: a batch-1 decode step is ~300 back-to-back kernels, and each one pays a fixed cost at its
start (launch, block dispatch, the first loads' DRAM latency) and at its end (the last blocks'
tail) during which the memory system is mostly idle: ~2-3 us per GEMV on an H200, which is what
keeps the small tensor-parallel and fp8 GEMVs well below copy bandwidth (benchmarks/QUANT_TP.md).
With PDL the next kernel is launched while the current one still runs, so its blocks are
dispatched, and can issue loads that do not depend on the current kernel, during that tail.

Protocol (CUDA's, per kernel that has a `PDL` constexpr and is launched with `launch_pdl`):
- `let_dependents_launch()` at the very start of every program: the next kernel may be launched
  once every program of this one has executed it (or exited). Its blocks then only take SM slots
  that are free: every program of this kernel is already resident by then, so the dependent can
  never crowd this kernel out.
- `wait_for_predecessor()` before the first read of anything an earlier kernel wrote, and before
  any write: it returns once the previous kernel has completed and its memory is visible. Every
  PDL kernel waits before it completes, so completion is transitive along the chain: after the
  wait, every earlier kernel of the stream has finished.
- Before the wait a kernel may only read what no earlier kernel of the step writes: the decode
  GEMVs load their first weight tile there (shard/kernels/gemv.py), which is what overlaps the
  previous kernel's tail. (An earlier attempt, reverted in session 3, had every GEMV program
  bulk-prefetch all of its weight rows into L2 before the wait: on the large shapes that pushed
  most of the weight through L2 twice and made the step slower.)

Kernels that are not PDL-launched (torch's, cuBLAS) wait for the previous kernel as usual, and a
PDL kernel after one of them simply starts when it finishes. `enabled` decides per device (sm_90
and later); `override` lets benchmarks compare with PDL off in the same process.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager

import torch
import triton
import triton.language as tl

from shard.kernels.setting import Setting

# benchmarks' A/B switch (override): None follows the device.
_FORCED: Setting[bool | None] = Setting(None)


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    """Whether Triton kernels on `device` are launched as programmatic dependents."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _supported(index):
        return False
    return True if _FORCED.value is None else bool(_FORCED.value)


def launch_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for launching a kernel with a `PDL` constexpr on `device` (the flag and
    Triton's launch option; the interpreter on CPU gets only the flag)."""
    if device.type != "cuda":
        return {"PDL": False}
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}


def override(on: bool) -> AbstractContextManager[None]:
    """Forces PDL on or off (where supported) for launches made inside the block: benchmarks
    compare both in one process (shard/kernels/setting.py)."""
    return _FORCED.override(on)


@triton.jit
def let_dependents_launch(PDL: tl.constexpr):
    """Protocol step 1 (see the module docstring); nothing without PDL."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """Protocol step 2: returns once the previous kernel has completed; nothing without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
