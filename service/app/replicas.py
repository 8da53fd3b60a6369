"""`tokenwire launch --replicas N`: N replicas of one model behind one gateway, on one host.

Replica i is a `tokenwire launch` of its own (its shards and router; gRPC on --port + i, metrics
on --prometheus-port + i, its own shard sockets and rendezvous port; with --device cuda the GPUs
[i * num_shard, (i + 1) * num_shard) through CUDA_VISIBLE_DEVICES, else one CPU process group
each). In front, `tokenwire gateway` (Envoy + the endpoint picker) serves --http-port. The model
is resolved (downloaded, converted) once here, before any replica starts.

Supervision: a replica that exits is reported and left out (the gateway's health checks have
already ejected it); the deployment goes on while one replica lives. The gateway exiting, or the
last replica, stops everything with status 1. SIGTERM/SIGINT: every replica drains (up to
--graceful-timeout, the gateway still carrying their streams and sending new requests to the
others while they can take them), then the gateway stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from service.app.launcher import (
    PASS_THROUGH,
    _child_setup,
    cache_dir,
    ensure_local_model,
    health_status,
    tokenwire_command,
)
from service.app.ports import free_port
from service.app.router_flags import AUTO, resolve_frontends

# --shutdown-delay of each replica unless given: two of the gateway's health-check intervals.
REPLICA_SHUTDOWN_DELAY_S = 2.0
# Flags a replica gets from this launcher itself, not copied from the command line.
_PER_REPLICA = {"--prometheus-port"}


def _log(message: str) -> None:
    print(f"tokenwire launch: {message}", file=sys.stderr, flush=True)


@dataclass
class ReplicaProcess:
    index: int
    port: int
    metrics_port: int
    process: subprocess.Popen[bytes]

    @property
    def name(self) -> str:
        return f"replica {self.index}"


def _passed_flags(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    for spec in PASS_THROUGH:
        if spec.flag not in _PER_REPLICA:
            out += spec.argv(args)
    return out


def replica_command(
    args: argparse.Namespace, model_dir: Path, port: int, metrics_port: int
) -> list[str]:
    cmd = [
        "--model-id",
        str(model_dir),
        "--num-shard",
        str(args.num_shard),
        "--hostname",
        args.hostname,
        "--port",
        str(port),
        "--prometheus-port",
        str(metrics_port),
        "--master-addr",
        args.master_addr,
        "--graceful-timeout",
        str(args.graceful_timeout),
        "--startup-timeout",
        str(args.startup_timeout),
    ]
    if args.shutdown_delay is None:
        # The gateway checks health every second and ejects after two failed checks: a
        # replica that drains faster still answers NOT_SERVING to both.
        cmd += ["--shutdown-delay", str(REPLICA_SHUTDOWN_DELAY_S)]
    return tokenwire_command("launch", *cmd, *_passed_flags(args))


def gateway_command(args: argparse.Namespace, replicas: list[ReplicaProcess]) -> list[str]:
    host = "127.0.0.1" if args.hostname in ("0.0.0.0", "") else args.hostname
    backends = ",".join(f"{host}:{r.port}/{r.metrics_port}" for r in replicas)
    cmd = [
        "--backends",
        backends,
        "--http-port",
        str(args.http_port),
        "--http-hostname",
        args.http_hostname,
        "--admin-port",
        str(args.envoy_admin_port),
    ]
    if args.max_request_bytes is not None:
        cmd += ["--max-request-bytes", str(args.max_request_bytes)]
    if args.no_picker:
        cmd.append("--no-picker")
    if args.otlp_endpoint:
        cmd += ["--otlp-endpoint", args.otlp_endpoint]
    if args.otlp_service_name:
        cmd += ["--otlp-service-name", args.otlp_service_name]
    return tokenwire_command("gateway", *cmd)


def _replica_env(args: argparse.Namespace, index: int) -> dict[str, str]:
    env = dict(os.environ)
    if args.device == "cuda":
        first = index * args.num_shard
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + g) for g in range(args.num_shard))
    return env


def run_replicas(args: argparse.Namespace) -> int:
    if args.http_port is None:
        raise SystemExit("tokenwire launch: --replicas needs --http-port (the gateway's port)")
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    replicas: list[ReplicaProcess] = []
    gateway: subprocess.Popen[bytes] | None = None
    code = 0
    try:
        model_id, model_dir = ensure_local_model(
            args.model_id, args.revision, cache_dir(args.cache_dir), args.gguf_file,
            args.gguf_weights, args.device,
        )
        _log(f"model {model_id} from {model_dir}: {args.replicas} replicas")
        host = "127.0.0.1" if args.hostname in ("0.0.0.0", "") else args.hostname
        # Every replica gets the same front-end count, resolved here; with N >= 2 a router
        # serves metrics on PORT .. PORT+N, so the replicas' metrics ports are N+1 apart.
        args.frontends = resolve_frontends(args.frontends or AUTO)
        stride = args.frontends + 1 if args.frontends > 1 else 1
        for i in range(args.replicas):
            port = args.port + i
            metrics_port = (
                args.prometheus_port + i * stride if args.prometheus_port else free_port(host)
            )
            process = subprocess.Popen(
                replica_command(args, model_dir, port, metrics_port),
                env=_replica_env(args, i),
                preexec_fn=_child_setup,  # noqa: PLW1509
            )
            replicas.append(ReplicaProcess(i, port, metrics_port, process))
        deadline = time.monotonic() + args.startup_timeout
        for r in replicas:
            while health_status(f"{host}:{r.port}") != "SERVING":
                if r.process.poll() is not None:
                    raise RuntimeError(f"{r.name} exited with code {r.process.returncode}")
                if stop.is_set():
                    raise InterruptedError
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{r.name} not ready after {args.startup_timeout:.0f}s")
                stop.wait(0.2)
            _log(f"{r.name} serving on {host}:{r.port} (metrics :{r.metrics_port})")
        gateway = subprocess.Popen(gateway_command(args, replicas), preexec_fn=_child_setup)  # noqa: PLW1509
        _wait_gateway(args, gateway, stop)
        _log(f"ready: {len(replicas)} replicas behind the gateway on port {args.http_port}")
        code = _supervise(replicas, gateway, stop)
    except InterruptedError:
        _log("interrupted during startup: stopping")
    except Exception as error:  # noqa: BLE001 - stop what was started, say why
        _log(f"error: {error}: stopping everything")
        code = 1
    finally:
        _shutdown(args, replicas, gateway)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code == 0:
        _log("stopped")
    return code


def _wait_gateway(
    args: argparse.Namespace, gateway: subprocess.Popen[bytes], stop: threading.Event
) -> None:
    import http.client

    host = "127.0.0.1" if args.http_hostname in ("0.0.0.0", "") else args.http_hostname
    deadline = time.monotonic() + 60.0
    while True:
        if gateway.poll() is not None:
            raise RuntimeError(f"gateway exited with code {gateway.returncode}")
        if stop.is_set():
            raise InterruptedError
        conn = http.client.HTTPConnection(host, args.http_port, timeout=2)
        try:
            conn.request("GET", "/__tokenwire_gateway_probe")
            if conn.getresponse().status == 404:
                return
        except (OSError, http.client.HTTPException):
            pass
        finally:
            conn.close()
        if time.monotonic() > deadline:
            raise RuntimeError("gateway did not answer in 60 s")
        stop.wait(0.1)


def _supervise(
    replicas: list[ReplicaProcess], gateway: subprocess.Popen[bytes], stop: threading.Event
) -> int:
    gone: set[int] = set()
    while not stop.wait(0.2):
        if gateway.poll() is not None:
            _log(f"gateway exited with code {gateway.returncode}: stopping everything")
            return 1
        for r in replicas:
            if r.index not in gone and r.process.poll() is not None:
                gone.add(r.index)
                _log(
                    f"{r.name} exited with code {r.process.returncode}; "
                    f"{len(replicas) - len(gone)} replica(s) left"
                )
        if len(gone) == len(replicas):
            _log("no replica left: stopping")
            return 1
    _log("draining the replicas")
    return 0


def _shutdown(
    args: argparse.Namespace,
    replicas: list[ReplicaProcess],
    gateway: subprocess.Popen[bytes] | None,
) -> None:
    for r in replicas:
        if r.process.poll() is None:
            r.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + args.graceful_timeout + 15.0
    for r in replicas:
        try:
            r.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _log(f"{r.name} did not stop in time: killing it")
            r.process.kill()
            r.process.wait()
    if gateway is not None and gateway.poll() is None:
        gateway.send_signal(signal.SIGTERM)
        try:
            gateway.wait(10.0)
        except subprocess.TimeoutExpired:
            gateway.kill()
            gateway.wait()
