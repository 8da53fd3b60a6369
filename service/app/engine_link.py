"""The unix-socket link between the scheduler process and its front ends: length-prefixed pickled
frames (a 4-byte big-endian length, then the pickle), and the garbage-collector tuning the front
ends apply once started (the scheduler process's engine paces its own: shard.runtime.gc_pacing).

Messages (tuples, first item the kind): front end -> scheduler: ("hello",), ("sub", key,
ValidatedRequest), ("cancel", key), ("ack",), ("adm", call, "load", [AdapterSource]) /
("adm", call, "unload", name) (LoRA admin calls), ("adapters_ack", version); scheduler -> front
end: ("hello", WarmupInfo, ShardDescription, Limits), ("ev", rows), ("fail", key, EngineError),
("stats", EngineStats), ("unhealthy", reason), ("adapters", version, [AdapterInfo]) (the
adapter set requests may name, sent to every front end after each change), ("admr", call,
result, error) (an admin call's answer, sent once every front end acknowledged the new set).
"""

from __future__ import annotations

import asyncio
import gc
import pickle
import struct
from typing import Any

_HEADER = struct.Struct("!I")


def frame(message: object) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


ACK = frame(("ack",))


async def read_frame(reader: asyncio.StreamReader) -> Any:
    (n,) = _HEADER.unpack(await reader.readexactly(4))
    return pickle.loads(await reader.readexactly(n))


def tune_gc() -> None:
    """Long-lived startup objects out of the collector, and fewer gen-0 passes: the hot path
    allocates many short-lived acyclic objects (protos, events)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 50)
