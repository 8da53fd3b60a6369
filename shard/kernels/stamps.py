"""Device timestamps inside a kernel, for latency diagnosis (benchmarks only, compiled out
otherwise).

Why: at decode batch 1 a launch's time is a chain of dependent steps (the PDL wait, a few L2
round trips, CTA barriers, a ticket), not bytes; a profiler sees only each kernel's span. A
kernel with a `STAMPS` constexpr records `%globaltimer` (ns, one clock for the whole GPU) at
named points of every program into int64 rows [programs, STAMP_SLOTS] (row: `program_index()`).
With `STAMPS=False` the stores are not compiled at all.

Two ways in:
- a launch's own `stamps=` argument (benchmarks/attention_stamps.py);
- `recording(StampRecorder(...))`: every stamped launch captured into a CUDA graph inside the
  block takes the next rows of the recorder's buffer (`take`), with its kernel name and point
  names, so one replay stamps a whole decode step (benchmarks/moe_b1_bench.py --stamps). Eager
  launches inside the block stamp into scratch rows: they compile the stamped variant before
  the capture (a module first loaded inside a capture invalidates it), and are not analysed.

The timer read is volatile inline PTX: the compiler keeps it in program order with the other
side-effecting instructions (loads, stores, barriers, atomics), so a stamp after a load marks
its issue; a stamp after a store or a branch on a loaded value marks the value's arrival.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from shard.kernels.setting import Setting

STAMP_SLOTS = 8  # int64 stamps per program (the literal 8 in `stamp`)


@triton.jit
def now_ns():
    """The GPU's global timer (int64 ns), read where the program reaches this call."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def program_index():
    """This program's row: its grid coordinates, the last axis fastest."""
    return ((tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2)
            + tl.program_id(2))


@triton.jit
def stamp(stamps_ptr, program, point: tl.constexpr, ON: tl.constexpr):
    """stamps[program, point] = now (ON only): stamps_ptr is int64 [programs, STAMP_SLOTS]."""
    if ON:
        tl.store(stamps_ptr + program * 8 + point, now_ns())


@dataclass(frozen=True)
class StampedLaunch:
    """One captured launch's rows of a StampRecorder's buffer."""

    kernel: str
    first: int  # first row
    programs: int
    points: tuple[str, ...]  # the kernel's point names, by stamp slot


@dataclass
class StampRecorder:
    """Rows for every stamped launch of a CUDA-graph capture, in launch order (see the module
    docstring). `buffer` int64 [capacity, STAMP_SLOTS] on `device`."""

    capacity: int
    device: torch.device
    launches: list[StampedLaunch] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.buffer = torch.zeros(self.capacity, STAMP_SLOTS, dtype=torch.int64,
                                  device=self.device)
        self._scratch = torch.zeros(0, STAMP_SLOTS, dtype=torch.int64, device=self.device)
        self._used = 0

    def take(self, kernel: str, programs: int, points: tuple[str, ...]) -> torch.Tensor:
        if not torch.cuda.is_current_stream_capturing():
            if self._scratch.shape[0] < programs:  # eager: scratch (never inside a capture)
                self._scratch = torch.zeros(programs, STAMP_SLOTS, dtype=torch.int64,
                                            device=self.device)
            return self._scratch[:programs]
        if self._used + programs > self.capacity:
            raise RuntimeError(f"StampRecorder: {self.capacity} rows are too few for "
                               f"{kernel} ({programs} programs after {self._used} rows)")
        self.launches.append(StampedLaunch(kernel, self._used, programs, points))
        rows = self.buffer[self._used:self._used + programs]
        self._used += programs
        return rows

    def rows(self, launch: StampedLaunch) -> torch.Tensor:
        return self.buffer[launch.first:launch.first + launch.programs]


_RECORDER: Setting[StampRecorder | None] = Setting(None)


def recording(recorder: StampRecorder) -> AbstractContextManager[None]:
    """Inside the block stamped launches take their rows from `recorder`."""
    return _RECORDER.override(recorder)


def take(kernel: str, programs: int, points: tuple[str, ...]) -> torch.Tensor | None:
    """A launch's stamp rows inside `recording`, else None (its STAMPS off)."""
    recorder = _RECORDER.value
    return None if recorder is None else recorder.take(kernel, programs, points)
