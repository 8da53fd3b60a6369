"""Free loopback ports and unix socket paths for servers started by tests."""

from __future__ import annotations

import itertools
import os
import random
import socket
import tempfile
from pathlib import Path

# Ports the tests hand to servers come from below Linux's ephemeral range (32768-60999 by
# default), which the kernel draws from for bind(0) and for every outgoing connection's source
# port: a port chosen there could be taken by anything's next connect() before the test's server
# binds it. Under pytest-xdist each worker draws from its own slice, so two workers never hand out
# the same port either.
_PORTS_FIRST, _PORTS_END = 20000, 32000
# Ports are handed out _BLOCK apart: a server given port P may bind P+1, P+2, ... itself (the
# launcher's front ends and shard metrics take --prometheus-port + index), and those must not be
# the port the next free_port() call hands to another server of the same test.
_BLOCK = 16


class _PortSequence:
    """One worker's slice of [_PORTS_FIRST, _PORTS_END), walked from a random start so that a
    port is handed out again only after the whole slice (thousands of ports) has been."""

    def __init__(self, worker: int, workers: int) -> None:
        span = (_PORTS_END - _PORTS_FIRST) // max(workers, 1)
        self.first = _PORTS_FIRST + worker * span
        self.span = span
        self.blocks = span // _BLOCK  # ports handed out: first, first + _BLOCK, ...
        self.steps = itertools.count(random.randrange(self.blocks))

    def next_port(self) -> int:
        return self.first + (next(self.steps) % self.blocks) * _BLOCK


def _worker() -> tuple[int, int]:
    """(this xdist worker's index, the worker count); (0, 1) outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0
    return index % count, count


_sequences: dict[tuple[int, int], _PortSequence] = {}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, from this worker's slice (see above)."""
    worker = _worker()
    sequence = _sequences.get(worker)
    if sequence is None:
        sequence = _sequences[worker] = _PortSequence(*worker)
    for _ in range(sequence.blocks):
        port = sequence.next_port()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:  # in use: a server of an earlier test, or another program
                continue
            return port
    raise RuntimeError(f"no free port in {sequence.first}-{sequence.first + sequence.span - 1}")


def short_socket_prefix(name: str = "tw") -> str:
    """A unix socket path prefix short enough for the 108-byte sun_path limit (pytest's tmp_path
    can be too long), in a fresh private directory."""
    return str(Path(tempfile.mkdtemp(prefix=f"{name}-", dir="/tmp")) / "s")
