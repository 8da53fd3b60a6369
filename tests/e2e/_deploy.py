"""Helpers of the end-to-end tests: run a real `tokenwire launch` and talk to it over HTTP/gRPC."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Deployment:
    """One `tokenwire launch` process and the ports it serves."""

    process: subprocess.Popen[bytes]
    log_path: Path
    grpc_port: int
    http_port: int | None
    metrics_port: int
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def envoy_target(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def launch(
    tmp: Path,
    *extra: str,
    http: bool = True,
    env: dict[str, str] | None = None,
    timeout: float = 150.0,
    api_key: str | None = None,
    default_model: bool = False,
) -> Deployment:
    """Starts `tokenwire launch` and waits for its "ready" line. Serves the tiny random model
    from the cache (fast) unless `extra` names a --model-id; `default_model=True` leaves
    --model-id out, so the embedded default is served."""
    grpc_port, metrics_port = free_port(), free_port()
    http_port = free_port() if http else None
    args = [
        sys.executable,
        "-m",
        "service.app.cli",
        "launch",
        "--port",
        str(grpc_port),
        "--prometheus-port",
        str(metrics_port),
        "--envoy-admin-port",
        "0",
    ]
    if http_port is not None:
        args += ["--http-port", str(http_port), "--http-hostname", "127.0.0.1"]
    if api_key is not None:
        args += ["--api-key", api_key]
    full_env = dict(os.environ)
    full_env.setdefault("TOKENWIRE_CACHE", str(tmp.parent / "tokenwire-cache"))
    full_env.update(env or {})
    if not default_model and "--model-id" not in extra and "MODEL_ID" not in full_env:
        from service.app.launcher import ensure_tiny_model

        args += ["--model-id", str(ensure_tiny_model(Path(full_env["TOKENWIRE_CACHE"])))]
    args += list(extra)
    log_path = tmp / f"launch-{grpc_port}.log"
    log_file = log_path.open("wb")
    process = subprocess.Popen(args, cwd=REPO, env=full_env, stdout=log_file, stderr=log_file)
    deployment = Deployment(
        process,
        log_path,
        grpc_port,
        http_port,
        metrics_port,
        headers={"authorization": f"Bearer {api_key}"} if api_key else {},
    )
    deadline = time.monotonic() + timeout
    while "tokenwire launch: ready" not in deployment.log():
        if process.poll() is not None:
            raise RuntimeError(f"launch exited with {process.returncode}:\n{deployment.log()}")
        if time.monotonic() > deadline:
            deployment.stop(signal.SIGKILL)
            raise RuntimeError(f"launch not ready in {timeout}s:\n{deployment.log()}")
        time.sleep(0.2)
    return deployment


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


def metric(port: int, name: str) -> float:
    """Value of an unlabelled Prometheus sample from the router's metrics endpoint."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{}")):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"metric {name} not found")


def expect_error_status(path: str, status: int, body: object, expected: int) -> None:
    """Asserts an error's HTTP status. Streams that fail before their first event are
    trailers-only responses (the router sends its initial metadata with the first event), so
    Envoy maps their status exactly as for unary calls."""
    assert status == expected, (path, status, body)
