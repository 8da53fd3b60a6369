"""The one free-port helper of the router's processes."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of `host` (IPv4, or IPv6 with or without brackets) that was free a moment ago:
    the kernel's choice. For ports a process must name before the listener binds them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host.strip("[]"), 0))
        return int(sock.getsockname()[1])
