"""A serving shard's GPU timeline, for measuring how busy the device is under real traffic.

    tokenwire shard ... --profile-from-step 200 --profile-dir /tmp/prof

From the step numbered `first_step` (steps counted from 0 in launch order, warm-up excluded) to
the shard's shutdown, two records are kept and written to DIR when the server stops:

- `trace.json.gz`: a torch.profiler trace of the device's activity (CUDA kernels and copies;
  no CPU ops), saved by the profiler's own exporter. Stopping the profiler parses every event
  (seconds for a few hundred thousand kernels), so it happens at shutdown, after the traffic,
  never in a step;
- `steps.json`: each step's device time and the device time between consecutive steps (CUDA
  events around each step's forward pass and sampling, `shard.engine.step_timer`; read only at
  shutdown, so timing never makes the host wait), each step's kind (prefill: the step has
  prompt chunks; decode) and its host timeline in ms from the first profiled step: when its
  RPC reached the servicer, when its launch began and ended on the model worker. Written
  before the trace, which may take longer than a supervisor waits.

Off by default; for benchmarks and performance investigations (benchmarks/OVERLAP.md).
"""

from __future__ import annotations

import gzip
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shard.engine.step_timer import GpuStepTimer

log = logging.getLogger(__name__)


def export_trace_gz(prof: torch.profiler.profile, path: Path) -> None:
    """A stopped profiler's Chrome trace, gzipped (path ends in .json.gz)."""
    raw = path.with_suffix("")  # the uncompressed .json beside it, removed after
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()


@dataclass(frozen=True)
class ProfileWindow:
    first_step: int  # steps before this one run unprofiled (warm-up of the traffic)
    out_dir: Path


class StepProfiler:
    """Counts the steps a shard launches and records the device from `first_step` on. Every
    method runs on the model worker thread (the profiler stops on the thread it started on)."""

    def __init__(self, window: ProfileWindow, engine: Any, device: torch.device) -> None:
        self.window = window
        self.engine = engine  # shard.engine.batches.BatchState: its gpu_timer is set here
        self.device = device
        self.steps = 0
        self.kinds: list[str] = []
        # Host timeline of each profiled step, perf_counter seconds: when its RPC reached the
        # servicer, when its launch started and ended on the model worker.
        self.host: list[tuple[float, float, float]] = []
        self._prof: torch.profiler.profile | None = None
        self._timer: GpuStepTimer | None = None

    def before_launch(self, kind: str) -> None:
        """Called before each step is launched (kind: "prefill" or "decode")."""
        if self.steps == self.window.first_step:
            self._start()
        self.steps += 1
        if self._timer is not None:
            self.kinds.append(kind)

    def launched(self, arrived: float, launch_start: float, launch_end: float) -> None:
        """Called after each step's launch with its host timestamps (perf_counter)."""
        if self._timer is not None:
            self.host.append((arrived, launch_start, launch_end))

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities = [torch.profiler.ProfilerActivity.CUDA]
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.__enter__()
        self._timer = GpuStepTimer(self.device)
        self.engine.gpu_timer = self._timer
        log.info("profiling from step %d", self.steps)

    def close(self) -> None:
        """Stops recording and writes trace.json.gz and steps.json (nothing when the window
        was never reached)."""
        prof, timer = self._prof, self._timer
        self._prof = self._timer = None
        if prof is None or timer is None:
            log.info(
                "profiling: step %d never reached (%d steps)", self.window.first_step, self.steps
            )
            return
        self.engine.gpu_timer = None
        out = self.window.out_dir
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        origin = self.host[0][0] if self.host else 0.0
        (out / "steps.json").write_text(
            json.dumps(
                {  # first: the trace may take long
                    "first_step": self.window.first_step,
                    "steps": self.steps,
                    "kinds": self.kinds[: timer.steps],
                    "step_ms": timer.step_ms(),
                    "gaps_ms": timer.gaps_ms(),
                    "host_ms": [[round((t - origin) * 1e3, 3) for t in h] for h in self.host],
                }
            )
        )
        prof.__exit__(None, None, None)
        export_trace_gz(prof, out / "trace.json.gz")
        log.info(
            "profile of steps %d..%d written to %s in %.1f s",
            self.window.first_step,
            self.steps - 1,
            out,
            time.perf_counter() - t0,
        )
