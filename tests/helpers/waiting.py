"""Waiting on a condition instead of sleeping: poll until it holds or fail with a message."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(
    condition: Callable[[], object], timeout: float, interval: float = 0.05, what: str = ""
) -> None:
    """Polls `condition` until it is truthy; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not met in {timeout} s: {what or condition}")
        time.sleep(interval)


async def until(
    condition: Callable[[], object], timeout: float, interval: float = 0.02, what: str = ""
) -> None:
    """wait_until for coroutines: polls without blocking the event loop (a condition that does
    blocking I/O, such as a metrics scrape, still blocks it for that call)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not met in {timeout} s: {what or condition}")
        await asyncio.sleep(interval)
