"""The scheduler process's side of a front end's connection: the connection is registered for
broadcasts (periodic stats, adapter sets, health) only once its hello answer is written, so a
front end's first frame is always the hello it waits for (a loaded CI run saw a stats frame come
first and the front end exit with an AssertionError)."""

from __future__ import annotations

import asyncio
from typing import Any

from service.app.engine_link import frame, read_frame
from service.app.scheduler_process import _FrontEndConnection


class _Writer:
    """A StreamWriter that keeps what was written."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return False


async def _frames(data: bytes) -> list[Any]:
    reader = asyncio.StreamReader()
    reader.feed_data(bytes(data))
    reader.feed_eof()
    out = []
    while not reader.at_eof():
        out.append(await read_frame(reader))
    return out


async def test_broadcasts_reach_a_front_end_only_after_its_hello() -> None:
    writer = _Writer()
    conn = _FrontEndConnection(engine=None, writer=writer)  # type: ignore[arg-type]
    registered: list[_FrontEndConnection] = []

    def broadcast_stats() -> None:  # what push_stats does for every registered connection
        for c in registered:
            c.send(("stats", {"steps": 0}))

    reader = asyncio.StreamReader()
    reader.feed_data(frame(("hello",)))
    reader.feed_eof()
    broadcast_stats()  # a broadcast while the front end is connecting: not for it yet
    await conn.serve(reader, ("warm", "shard", "limits"), on_hello=lambda: registered.append(conn))
    broadcast_stats()
    frames = await _frames(bytes(writer.data))
    assert [f[0] for f in frames] == ["hello", "stats"]
    assert frames[0] == ("hello", "warm", "shard", "limits")
    assert registered == [conn]
