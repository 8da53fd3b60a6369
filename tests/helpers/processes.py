"""Real server processes for process-level tests: spawn `tokenwire <subcommand>` with its output
in a log file, wait for grpc.health.v1 readiness, and always clean up (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers.ports import free_port, short_socket_prefix

REPO = Path(__file__).resolve().parents[2]


def tokenwire_argv(subcommand: str, *args: str) -> list[str]:
    """The command line of `tokenwire SUBCOMMAND ARGS` with this interpreter."""
    return [sys.executable, "-m", "service.app.cli", subcommand, *args]


def quiet_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for child servers: one math thread each (CI machines are small), offline."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


@dataclass
class ManagedProcess:
    """A child process whose stdout and stderr go to `log_path`."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=quiet_env)
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def kill9(self) -> None:
        if self.alive:
            os.kill(self.pid, signal.SIGKILL)
            assert self.popen is not None
            self.popen.wait(10)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        return self.popen.returncode


def health_status(target: str, service: str = "", timeout: float = 2.0) -> int | None:
    """grpc.health.v1 status of `target` (health_pb2.HealthCheckResponse.*), None if no answer."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
            return int(reply.status)
        except grpc.RpcError:
            return None


def wait_for_health(
    target: str,
    processes: Sequence[ManagedProcess],
    timeout: float = 180.0,
    status: int = health_pb2.HealthCheckResponse.SERVING,
) -> None:
    """Waits until `target` reports `status`; fails early (with logs) if a process dies."""
    deadline = time.monotonic() + timeout
    while True:
        if health_status(target) == status:
            return
        for process in processes:
            if not process.alive:
                raise AssertionError(
                    f"{process.name} exited with {process.popen and process.popen.returncode}:\n"
                    f"{process.log_tail()}"
                )
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in processes)
            raise AssertionError(f"{target} not {status} after {timeout} s\n{logs}")
        time.sleep(0.2)


@dataclass
class Deployment:
    """One shard process and one router process on loopback."""

    shard: ManagedProcess
    router: ManagedProcess
    port: int
    metrics_port: int
    uds_prefix: str

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def stop(self) -> None:
        self.router.stop()
        self.shard.stop()


def start_deployment(
    model_dir: Path,
    log_dir: Path,
    router_args: Sequence[str] = (),
    shard_args: Sequence[str] = (),
    timeout: float = 180.0,
) -> Deployment:
    """Starts `tokenwire shard` (rank 0 on a fresh unix socket) and `tokenwire router` in front
    of it, and waits until the router's health is SERVING."""
    prefix = short_socket_prefix()
    port, metrics_port = free_port(), free_port()
    shard = ManagedProcess(
        "shard",
        tokenwire_argv("shard", "--model-id", str(model_dir), "--uds-path", prefix, *shard_args),
        log_dir / "shard.log",
    ).start()
    router = ManagedProcess(
        "router",
        tokenwire_argv(
            "router",
            "--hostname",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-port",
            str(metrics_port),
            "--prometheus-hostname",
            "127.0.0.1",
            "--shard-uds-path",
            prefix,
            "--tokenizer",
            str(model_dir),
            *router_args,
        ),
        log_dir / "router.log",
    ).start()
    deployment = Deployment(shard, router, port, metrics_port, prefix)
    try:
        wait_for_health(deployment.target, [shard, router], timeout)
    except BaseException:
        deployment.stop()
        raise
    return deployment


def run_checked(args: Sequence[str | Path], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Runs a command to completion; fails the test with its output when it exits non-zero."""
    result = subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        check=False,
        **kwargs,  # type: ignore[call-overload]
    )
    assert result.returncode == 0, f"{list(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result
