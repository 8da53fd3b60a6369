"""A process-wide on/off option of a layer's fast path, with a scoped override (benchmarks
compare both settings in one process; tests pin one)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class Toggle:
    """`bool(toggle)` is the current setting; `with toggle.override(on):` sets it inside the
    block. A CUDA graph replays what was captured: capture under the setting it runs with."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def __bool__(self) -> bool:
        return self.on

    @contextmanager
    def override(self, on: bool) -> Iterator[None]:
        previous, self.on = self.on, on
        try:
            yield
        finally:
            self.on = previous
