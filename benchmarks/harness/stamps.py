"""Per-launch phases from a step's kernel stamps (shard/kernels/stamps.py: a StampRecorder's
buffer after a CUDA-graph replay), for benchmarks/moe_b1_bench.py --stamps.

For each stamped launch, in us (one GPU clock, %globaltimer):
- `span`: its first program's return from the PDL wait (point 1) to its last stamp;
- `gap`: the previous stamped launch's last stamp to this one's first return from the wait
  (the kernels between them, if any are not stamped, and the dependent launch's hop);
- `early`: how long before that previous end this launch's first program had started;
- per later point, the step from the point before it: for the program that ended last
  (`critical`) and the mean over the programs that passed both.
A stamp older than its program's own start (point 0) is an earlier replay's (a program that
returned before that point this time): ignored.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np


def launch_phases(rows: np.ndarray, points: tuple[str, ...]) -> dict[str, Any]:
    """rows: int64 ns [programs, slots]; points: the kernel's point names by slot (0: start,
    1: after the PDL wait). Times in us; start/release/end absolute."""
    s = rows[:, :len(points)].astype(np.float64) / 1e3
    valid = (s > 0) & (s >= s[:, :1])  # this replay's stamps
    last = np.where(valid, s, -np.inf).max(axis=1)  # [programs]
    critical = int(np.argmax(last))
    out: dict[str, Any] = {"start": float(s[:, 0].min()),
                           "release": float(np.where(valid[:, 1], s[:, 1], np.inf).min()),
                           "end": float(last.max()), "critical": {}, "mean": {}}
    out["span"] = out["end"] - out["release"]
    out["critical"]["lag"] = float(s[critical, 1] - out["release"])
    for k in range(2, len(points)):
        both = valid[:, k] & valid[:, k - 1]
        step = s[:, k] - s[:, k - 1]
        name = f"{points[k - 1]} -> {points[k]}"
        if both[critical]:
            out["critical"][name] = float(step[critical])
        if both.any():
            out["mean"][name] = float(step[both].mean())
    return out


def step_phases(launches: list[tuple[str, np.ndarray, tuple[str, ...]]]) -> dict[str, Any]:
    """launches: (kernel, rows, points) in launch order (one replay of a step). The mean of
    each kernel's launches (launch_phases, plus gap and early against the stamped launch
    before it; a kernel's first launch of the step has none)."""
    sums: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    previous_end: float | None = None
    for kernel, rows, points in launches:
        p = launch_phases(rows, points)
        acc = sums[kernel]
        acc["span"].append(p["span"])
        if previous_end is not None:
            acc["gap"].append(p["release"] - previous_end)
            acc["early"].append(previous_end - p["start"])
        for which in ("critical", "mean"):
            for name, value in p[which].items():
                acc[f"{which}: {name}"].append(value)
        previous_end = p["end"]
    return {kernel: {"count": len(acc["span"]),
                     **{k: float(np.mean(v)) for k, v in acc.items()}}
            for kernel, acc in sums.items()}
