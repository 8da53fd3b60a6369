"""The reader side of a submitted request: a deque of events and at most one waiting reader.

One future per wait, none per event: a producer on the same event loop appends events and wakes
the reader only when it is waiting, which keeps the per-token cost of streaming low. The engine's
in-process streams and the front ends' remote streams (service/app/remote_engine.py) both build
on it.
"""

from __future__ import annotations

import asyncio
from collections import deque

from service.engine.contracts import EngineError, StepEvent


class EventStream:
    """A RequestStream (service/engine/contracts.py) fed by `push` / `fail`.

    Subclasses say what cancelling does (`_cancelled`) and may account for each event the
    reader takes (`_taken`)."""

    __slots__ = ("_closed", "_error", "_events", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._events: deque[StepEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._loop = loop  # None: looked up at the first wait (submitted before the loop ran)
        self._error: EngineError | None = None
        self._closed = False  # no more events will come

    # --- producer side --------------------------------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def push(self, event: StepEvent) -> None:
        self._events.append(event)
        if self._waiter is not None:
            self._wake()

    def fail(self, error: EngineError) -> None:
        """Ends the stream with `error` (raised to the reader after the queued events)."""
        if self._closed:
            return
        self._error = error
        self._closed = True
        self._wake()

    # --- reader side ----------------------------------------------------------------------------
    def _taken(self, event: StepEvent) -> StepEvent:
        """Called as the reader takes `event`; returns it."""
        return event

    def _cancelled(self) -> None:
        """Called once when the reader cancels before the stream closed."""

    def ready(self) -> int:
        """Events queued for the reader (taken without waiting)."""
        return len(self._events)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> StepEvent:
        while True:
            if self._events:
                return self._taken(self._events.popleft())
            if self._error is not None:
                err, self._error = self._error, None
                raise err
            if self._closed:
                raise StopAsyncIteration
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            await self._waiter

    def cancel(self) -> None:
        """Stops the request (removed at the next step boundary); iteration then ends."""
        if not self._closed:
            self._closed = True
            self._cancelled()
            self._wake()

    def stop(self) -> None:
        """Ends the request as finished by a stop sequence (RequestStream.stop); the stream
        stays open for the engine's last event."""
        if not self._closed:
            self._stopped()

    def _stopped(self) -> None:
        """Called when the reader stops the request (ids-only requests); by default a cancel."""
        self.cancel()

    async def aclose(self) -> None:
        self.cancel()
