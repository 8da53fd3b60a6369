"""Device timestamps inside a kernel, for latency diagnosis (benchmarks only, compiled out
otherwise).

Why: at decode batch 1 a launch's time is a chain of dependent steps (the PDL wait, a few L2
round trips, CTA barriers, a ticket), not bytes; a profiler sees only each kernel's span. A
kernel with a `STAMPS` constexpr records `%globaltimer` (ns, one clock for the whole GPU) at
named points of every program into a buffer the benchmark reads back
(benchmarks/attention_stamps.py). With `STAMPS=False` the stores are not compiled at all.

The timer read is volatile inline PTX: the compiler keeps it in program order with the other
side-effecting instructions, but a load issued before it may still be in flight (a stamp after
a load marks its issue, a stamp after the load's first use its arrival).
"""

from __future__ import annotations

import triton
import triton.language as tl

STAMP_SLOTS = 8  # int64 stamps per program


@triton.jit
def now_ns():
    """The GPU's global timer (int64 ns), read where the program reaches this call."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def stamp(stamps_ptr, program, point: tl.constexpr, ON: tl.constexpr):
    """stamps[program, point] = now (ON only): stamps_ptr is int64 [programs, STAMP_SLOTS]."""
    if ON:
        tl.store(stamps_ptr + program * 8 + point, now_ns())
