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


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on `host`:`port` (TCP). The probe binds without SO_REUSEPORT
    (SO_REUSEADDR only, so a closed connection's TIME_WAIT does not count): it fails exactly where
    another listener holds the port, even one that itself set SO_REUSEPORT."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError:
            return True
    return False
