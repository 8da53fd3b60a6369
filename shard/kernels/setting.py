"""A process-wide option of a kernel or layer with a scoped override: benchmarks compare both
settings of a fast path in one process, tests pin one. No Triton here (layers on CPU read them).

A launch compiles a kernel variant per setting and a CUDA graph replays what it captured: run
an eager call, then capture, under the setting the graph is replayed with."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class Setting(Generic[T]):
    """`setting.value` is the current value; `with setting.override(v):` sets it inside the
    block (restored on exit, also on an exception)."""

    def __init__(self, value: T) -> None:
        self.value = value

    @contextmanager
    def override(self, value: T) -> Iterator[None]:
        previous, self.value = self.value, value
        try:
            yield
        finally:
            self.value = previous
