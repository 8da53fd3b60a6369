"""Device time of the steps a shard runs (benchmarks: the pure-GPU bound of a workload).

`begin()` before a step's forward pass is queued and `end()` after its sampling kernels: on
CUDA a pair of events on the current stream, read only when `total_ms()` is asked (so timing
never makes the host wait for the device); on the CPU, where a step runs synchronously, wall
time between the two calls.
"""

from __future__ import annotations

import time

import torch


class GpuStepTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._open: torch.cuda.Event | None = None
        self._cpu_spans: list[tuple[int, int]] = []  # (begin, end) perf_counter_ns
        self._cpu_t0 = 0
        self.steps = 0

    def begin(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open = ev
        else:
            self._cpu_t0 = time.perf_counter_ns()

    def end(self) -> None:
        self.steps += 1
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            assert self._open is not None
            self._pairs.append((self._open, ev))
            self._open = None
        else:
            self._cpu_spans.append((self._cpu_t0, time.perf_counter_ns()))

    def step_ms(self) -> list[float]:
        """Each timed step's device time, in order (waits for the last one)."""
        if not self.cuda:
            return [(e - b) / 1e6 for b, e in self._cpu_spans]
        out = []
        for start, end in self._pairs:
            end.synchronize()
            out.append(start.elapsed_time(end))
        return out

    def gaps_ms(self) -> list[float]:
        """Device time between one step's end and the next step's begin: the input copies and
        placeholder kernels queued before a forward pass, plus any time the GPU waited for the
        host to queue it (entry k: between steps k and k+1). On the CPU: host time between
        the steps."""
        if not self.cuda:
            spans = self._cpu_spans
            return [(b[0] - a[1]) / 1e6 for a, b in zip(spans, spans[1:])]
        for _, end in self._pairs[-1:]:
            end.synchronize()
        return [a[1].elapsed_time(b[0]) for a, b in zip(self._pairs, self._pairs[1:])]

    def total_ms(self) -> float:
        """Sum over the timed steps of their device time (waits for the last one)."""
        return sum(self.step_ms())
