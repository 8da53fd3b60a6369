"""Free loopback ports and unix socket paths for servers started by tests."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def short_socket_prefix(name: str = "tw") -> str:
    """A unix socket path prefix short enough for the 108-byte sun_path limit (pytest's tmp_path
    can be too long), in a fresh private directory."""
    return str(Path(tempfile.mkdtemp(prefix=f"{name}-", dir="/tmp")) / "s")
