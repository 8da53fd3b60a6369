"""Real server processes for process-level tests: spawn `tokenwire <subcommand>` with its output
in a log file, wait until it is ready (grpc.health.v1, or `tokenwire launch`'s ready line), and
always clean up (SIGTERM, then SIGKILL). One `Deployment` describes what a test talks to: a
`tokenwire launch` process, or a `tokenwire shard` and a `tokenwire router`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers.ports import free_port, short_socket_prefix

REPO = Path(__file__).resolve().parents[2]


def terminate_popen(popen: subprocess.Popen, timeout: float = 20.0) -> int:
    """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
    popen.terminate()
    try:
        return popen.wait(timeout)
    except subprocess.TimeoutExpired:
        popen.kill()
        return popen.wait(10)


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
    # The router's default `--frontends auto` depends on the host's CPUs (1 below 8): the same
    # process layout on every host unless a test asks (--frontends, or FRONTENDS set outside).
    env.setdefault("FRONTENDS", "1")
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

    def log(self) -> str:
        """Everything the process wrote so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def send_signal(self, sig: int) -> None:
        assert self.popen is not None
        self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """Waits for the exit; returns the exit code (TimeoutExpired after `timeout`)."""
        assert self.popen is not None
        return self.popen.wait(timeout)

    def kill9(self) -> None:
        if self.alive:
            os.kill(self.pid, signal.SIGKILL)
            assert self.popen is not None
            self.popen.wait(10)

    def stop(self, timeout: float = 15.0, sig: int = signal.SIGTERM) -> int | None:
        """`sig` (SIGTERM), then SIGKILL after `timeout`; returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
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


def wait_ready(
    ready: Callable[[], bool], processes: Sequence[ManagedProcess], timeout: float, what: str
) -> None:
    """Polls `ready` until it holds; fails early (with logs) if a process dies, and after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not ready():
        for process in processes:
            if not process.alive:
                raise AssertionError(
                    f"{process.name} exited with {process.popen and process.popen.returncode}:\n"
                    f"{process.log_tail()}"
                )
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in processes)
            raise AssertionError(f"not {what} after {timeout} s\n{logs}")
        time.sleep(0.2)


def wait_for_health(
    target: str,
    processes: Sequence[ManagedProcess],
    timeout: float = 180.0,
    status: int = health_pb2.HealthCheckResponse.SERVING,
) -> None:
    """Waits until `target` reports `status`; fails early (with logs) if a process dies."""
    wait_ready(
        lambda: health_status(target) == status, processes, timeout, f"{target} health {status}"
    )


@dataclass
class Deployment:
    """Server processes on loopback and the ports they serve: `tokenwire launch` alone, or a
    `tokenwire shard` and a `tokenwire router`. The last process is the one clients talk to."""

    processes: list[ManagedProcess]  # in start order; stopped in reverse
    port: int  # the public gRPC port
    metrics_port: int
    http_port: int | None = None  # Envoy's REST/SSE port (launch --http-port)
    headers: dict[str, str] = field(default_factory=dict)  # what every HTTP call should send

    def named(self, name: str) -> ManagedProcess:
        return next(p for p in self.processes if p.name == name)

    @property
    def main(self) -> ManagedProcess:
        """`tokenwire launch`, or the router."""
        return self.processes[-1]

    @property
    def shard(self) -> ManagedProcess:
        return self.named("shard")

    @property
    def router(self) -> ManagedProcess:
        return self.named("router")

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def envoy_target(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log(self) -> str:
        return self.main.log()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Stops every process, the last started first; returns the main process's exit code."""
        codes = [p.stop(timeout, sig) for p in reversed(self.processes)]
        return codes[0]


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
    deployment = Deployment([shard, router], port, metrics_port)
    try:
        wait_for_health(deployment.target, [shard, router], timeout)
    except BaseException:
        deployment.stop()
        raise
    return deployment


def launch(
    tmp: Path,
    *extra: str,
    http: bool = True,
    env: dict[str, str] | None = None,
    timeout: float = 150.0,
    api_key: str | None = None,
    default_model: bool = False,
) -> Deployment:
    """Starts `tokenwire launch` and waits for its "ready" line. Serves the tiny random model from
    the cache (TOKENWIRE_CACHE, default tmp/../tokenwire-cache; fast) unless `extra` names a
    --model-id; `default_model=True` leaves --model-id out, so the embedded default is served."""
    port, metrics_port = free_port(), free_port()
    http_port = free_port() if http else None
    args = ["--port", str(port), "--prometheus-port", str(metrics_port), "--envoy-admin-port", "0"]
    if http_port is not None:
        args += ["--http-port", str(http_port), "--http-hostname", "127.0.0.1"]
    if api_key is not None:
        args += ["--api-key", api_key]
    full_env = {"TOKENWIRE_CACHE": str(tmp.parent / "tokenwire-cache"), **os.environ, **(env or {})}
    if not default_model and "--model-id" not in extra and "MODEL_ID" not in full_env:
        from service.app.launcher import ensure_tiny_model

        args += ["--model-id", str(ensure_tiny_model(Path(full_env["TOKENWIRE_CACHE"])))]
    process = ManagedProcess(
        "launch",
        tokenwire_argv("launch", *args, *extra),
        tmp / f"launch-{port}.log",
        env=quiet_env(full_env),
    ).start()
    deployment = Deployment(
        [process],
        port,
        metrics_port,
        http_port,
        headers={"authorization": f"Bearer {api_key}"} if api_key else {},
    )
    try:
        wait_ready(
            lambda: "tokenwire launch: ready" in process.log(), [process], timeout, "launch ready"
        )
    except BaseException:
        deployment.stop(signal.SIGKILL)
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
