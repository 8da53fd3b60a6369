"""The REST/SSE side of the public API (Envoy's transcoding) from tests: one JSON call, and the
events of a /generate_stream as they arrive."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator


def http_json(
    port: int,
    method: str,
    path: str,
    body: object | None = None,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    timeout: float = 60.0,
) -> tuple[int, dict[str, str], object]:
    """One HTTP request; returns (status, headers, parsed JSON or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, body=data, headers=all_headers)
    response = conn.getresponse()
    payload = response.read().decode()
    conn.close()
    try:
        parsed: object = json.loads(payload)
    except json.JSONDecodeError:
        parsed = payload
    return response.status, {k.lower(): v for k, v in response.getheaders()}, parsed


def sse_events(
    port: int,
    body: object,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
    limit: int | None = None,
) -> Iterator[tuple[float, object]]:
    """POST /generate_stream; yields (arrival time, event JSON) as each `data:` line arrives.
    Closes the connection after `limit` events (a client disconnecting mid-stream)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(
        "POST",
        "/generate_stream",
        body=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    response = conn.getresponse()
    if response.status != 200:
        raise AssertionError(f"status {response.status}: {response.read().decode()}")
    assert response.getheader("content-type", "").startswith("text/event-stream")
    count = 0
    try:
        while True:
            line = response.readline()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            yield time.monotonic(), json.loads(line[5:])
            count += 1
            if limit is not None and count >= limit:
                return
    finally:
        # Shut the socket down for real: a half-read response must look like a disconnect.
        if conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        conn.close()


def expect_error_status(path: str, status: int, body: object, expected: int) -> None:
    """Asserts an error's HTTP status. Streams that fail before their first event are
    trailers-only responses (the router sends its initial metadata with the first event), so
    Envoy maps their status exactly as for unary calls."""
    assert status == expected, (path, status, body)
