"""Full garbage collections paced by the serving loop: between bursts of work, not inside them.

CPython's generation-2 (full) collection walks every tracked object. In a shard (a model's
module tree, a thousand requests' state) or a router engine it takes 80-200 ms, and it runs
whenever enough objects survived younger collections: in the middle of a step, while every
stream and the GPU wait (benchmarks/OVERLAP.md measured six or seven such 150-230 ms stalls in
one 22 s H100 run). The step loops' objects are nearly all freed by reference counting
(requests, events, protos, tensors are acyclic), so full collections are only needed for the
rare cycle; they can wait.

`GcPacer.install()` freezes what start-up allocated (never collected again: it lives as long
as the process) and turns automatic full collections off; young generations keep being
collected automatically (cheap: they hold what was allocated since the last one). The loop
calls `idle()` when it has nothing to run (a full collection then costs no step anything: the
router's engine when it has no request, the shard's servicer once no step RPC came for a
moment) and `step()` after each step, which collects anyway once `max_interval_s` passed
without an idle one, so a server that is never idle still frees its cycles.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field

_log = logging.getLogger(__name__)

# Young generations: generation 0 after this many net allocations, generation 1 after this many
# generation-0 collections (CPython's defaults: 700 and 10; larger is fewer, cheap passes).
_GEN0_THRESHOLD = 20_000
_GEN1_THRESHOLD = 50
# Generation 2's threshold counts generation-1 collections: never reached in practice.
_NO_AUTOMATIC_FULL = 2**30


@dataclass
class GcPacer:
    max_interval_s: float = 60.0  # a busy server still collects fully this often
    full_collections: int = 0
    full_collection_ms: float = 0.0  # their total duration
    _last_full: float = field(default_factory=time.monotonic)

    def install(self) -> None:
        """Process-wide: collect and freeze start-up's objects, no automatic full collections.
        Call once, in the process that runs the engine, after start-up."""
        gc.collect()
        gc.freeze()
        gc.set_threshold(_GEN0_THRESHOLD, _GEN1_THRESHOLD, _NO_AUTOMATIC_FULL)
        self._last_full = time.monotonic()

    def idle(self) -> None:
        """The engine has nothing to run: a full collection, if anything reached generation 2
        since the last one."""
        if gc.get_count()[2] > 0:
            self._collect("idle")

    def step(self) -> None:
        """After a step: a full collection only when none ran for max_interval_s."""
        if time.monotonic() - self._last_full >= self.max_interval_s and gc.get_count()[2] > 0:
            self._collect("interval")

    def _collect(self, why: str) -> None:
        start = time.monotonic()
        found = gc.collect()
        self._last_full = end = time.monotonic()
        self.full_collections += 1
        self.full_collection_ms += (end - start) * 1e3
        _log.debug("full collection (%s): %.1f ms, %d unreachable", why, (end - start) * 1e3,
                   found)
