"""`tokenwire launch`: flags and environment, readiness, auth through Envoy, graceful drain on
SIGTERM, and tear-down naming the component when a child dies."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenwire.v1 import generate_pb2 as pb
from tokenwire.v1 import generate_pb2_grpc as pb_grpc

from service.app import launcher, router_flags
from service.app.cli import build_parser
from tests.helpers.http_api import expect_error_status, http_json, sse_events
from tests.helpers.metrics import scrape
from tests.helpers.processes import Deployment, health_status, launch
from tests.helpers.waiting import wait_until

API_KEY = "s3cret"


def parse(argv: list[str]):
    return build_parser(argv).parse_args(argv)


def test_flags_come_from_tgi_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "MODEL_ID": "/models/x",
        "NUM_SHARD": "2",
        "PORT": "6000",
        "HOSTNAME": "0.0.0.0",
        "MAX_INPUT_LENGTH": "100",
        "MAX_TOTAL_TOKENS": "200",
        "MAX_BATCH_PREFILL_TOKENS": "300",
        "API_KEY": "k",
        "JSON_OUTPUT": "true",
        "DTYPE": "bfloat16",
        "HTTP_PORT": "8081",
    }.items():
        monkeypatch.setenv(name, value)
    args = parse(["launch", "--max-total-tokens", "250"])  # a flag beats its variable
    assert (args.model_id, args.num_shard, args.port, args.hostname) == (
        "/models/x",
        2,
        6000,
        "0.0.0.0",
    )
    assert (args.max_input_tokens, args.max_total_tokens, args.http_port) == (100, 250, 8081)
    router = launcher.router_command(args, "x", Path("/models/x"), "/tmp/t/shard")
    joined = " ".join(router)
    for part in (
        "router",
        "--port 6000",
        "--shard-uds-path /tmp/t/shard",
        "--max-input-tokens 100",
        "--max-total-tokens 250",
        "--max-batch-prefill-tokens 300",
        "--api-key k",
        "--json-output",
        "--tokenizer /models/x",
    ):
        assert part in joined, joined
    assert "--dtype" not in joined  # shard flags stay with the shards
    shard = " ".join(launcher.shard_command(args, Path("/models/x"), 1, "/tmp/t/shard", 29500))
    for part in (
        "shard",
        "--rank 1",
        "--world-size 2",
        "--uds-path /tmp/t/shard",
        "--master-port 29500",
        "--dtype bfloat16",
    ):
        assert part in shard, shard
    assert "--max-total-tokens" not in shard


def test_unset_flags_keep_component_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MODEL_ID", "MAX_TOTAL_TOKENS", "MAX_INPUT_TOKENS", "MAX_INPUT_LENGTH", "API_KEY"):
        monkeypatch.delenv(name, raising=False)
    args = parse(["launch"])
    assert args.model_id is None and args.http_port is None
    router = launcher.router_command(args, "m", Path("/m"), "/p")
    assert "--max-total-tokens" not in router and "--api-key" not in router


def test_frontends_flag_reaches_the_router(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FRONTENDS", raising=False)
    monkeypatch.delenv("FRONTEND_BACKLOG_STEPS", raising=False)
    assert parse(["router"]).frontends == "auto"  # resolved from the CPUs at start-up
    assert "--frontends" not in launcher.router_command(parse(["launch"]), "m", Path("/m"), "/p")
    assert parse(["router"]).frontend_backlog_steps == 8.0
    args = parse(["launch", "--frontends", "3", "--frontend-backlog-steps", "4"])
    joined = " ".join(launcher.router_command(args, "m", Path("/m"), "/p"))
    assert "--frontends 3" in joined and "--frontend-backlog-steps 4.0" in joined, joined
    router_args = parse(joined.split(" service.app.cli ", 1)[1].split())
    assert (router_args.frontends, router_args.frontend_backlog_steps) == (3, 4.0)
    monkeypatch.setenv("FRONTENDS", "2")
    assert parse(["router"]).frontends == 2
    assert "--frontends 2" in " ".join(
        launcher.router_command(parse(["launch"]), "m", Path("/m"), "/p")
    )
    monkeypatch.setenv("FRONTENDS", "auto")
    assert parse(["router"]).frontends == "auto"
    assert "--frontends auto" in " ".join(
        launcher.router_command(parse(["launch"]), "m", Path("/m"), "/p")
    )
    assert parse(["launch", "--frontends", "AUTO"]).frontends == "auto"
    for bad in ("0", "two", "-1"):
        with pytest.raises(SystemExit):
            parse(["router", "--frontends", bad])
        with pytest.raises(SystemExit):
            parse(["launch", "--frontends", bad])


@pytest.mark.parametrize(
    ("value", "cpus", "expected"),
    [("auto", 1, 1), ("auto", 2, 1), ("auto", 7, 1), ("auto", 8, 2), ("auto", 12, 3),
     ("auto", 16, 4), ("auto", 64, 4), (1, 64, 1), (3, 2, 3)],
)  # fmt: skip
def test_frontends_auto_resolves_from_usable_cpus(value: object, cpus: int, expected: int) -> None:
    assert router_flags.resolve_frontends(value, cpus=cpus) == expected  # type: ignore[arg-type]


def test_frontends_auto_reads_the_affinity_mask() -> None:
    cpus = len(os.sched_getaffinity(0))
    assert router_flags.usable_cpus() == cpus
    assert router_flags.resolve_frontends("auto") == router_flags.resolve_frontends("auto", cpus)


@pytest.mark.parametrize(
    ("env", "flags", "frontends", "expected"),
    [(None, [], 1, False), (None, [], 4, True), ("auto", [], 2, True), ("on", [], 1, True),
     ("off", [], 4, False), (None, ["--router-detokenize"], 1, True),
     ("on", ["--no-router-detokenize"], 4, False)],
)  # fmt: skip
def test_router_detokenize_auto_follows_the_front_ends(
    monkeypatch: pytest.MonkeyPatch, env: str | None, flags: list[str], frontends: int,
    expected: bool,
) -> None:
    """Text in the router by default only where front-end processes share it."""
    import argparse

    if env is None:
        monkeypatch.delenv("ROUTER_DETOKENIZE", raising=False)
    else:
        monkeypatch.setenv("ROUTER_DETOKENIZE", env)
    parser = argparse.ArgumentParser()
    router_flags.add_arguments(parser)
    value = parser.parse_args(flags).router_detokenize
    assert router_flags.resolve_router_detokenize(value, frontends) is expected


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    # The API key through the environment, as TGI users set it.
    dep = launch(tmp_path_factory.mktemp("launch"), env={"API_KEY": API_KEY})
    dep.headers = {"authorization": f"Bearer {API_KEY}"}
    yield dep
    dep.stop()


@pytest.mark.slow
def test_tiny_model_in_cache(deployment: Deployment) -> None:
    cache = Path(
        os.environ.get("TOKENWIRE_CACHE")
        or deployment.main.log_path.parent.parent / "tokenwire-cache"
    )
    tiny = cache / launcher.TINY_MODEL_NAME
    assert (tiny / "config.json").is_file()
    status, _, info = http_json(deployment.http_port, "GET", "/info", headers=deployment.headers)
    assert status == 200 and info["model_id"] == str(tiny)


@pytest.mark.slow
def test_wrong_api_key_is_401(deployment: Deployment) -> None:
    body = {"inputs": "Testing API", "parameters": {"max_new_tokens": 3}}
    for headers in ({}, {"authorization": "Bearer wrong"}):
        status, _, reply = http_json(
            deployment.http_port, "POST", "/generate", body, headers=headers
        )
        assert status == 401 and reply["error_type"] == "unauthorized", reply
    status, _, reply = http_json(
        deployment.http_port, "POST", "/generate", body, headers=deployment.headers
    )
    assert status == 200, reply
    with grpc.insecure_channel(deployment.envoy_target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(pb.GenerateRequest(inputs="x"), metadata=[("authorization", "Bearer no")])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health stays open.
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    status, _, reply = http_json(
        deployment.http_port,
        "POST",
        "/generate_stream",
        body,
        headers={"authorization": "Bearer wrong"},
    )
    assert reply["error_type"] == "unauthorized", reply
    expect_error_status("/generate_stream", status, reply, 401)


@pytest.mark.slow
def test_sigterm_drains_in_flight_streams(deployment: Deployment) -> None:
    """Runs last in this module: it stops the deployment."""
    max_new = 400  # seconds of CPU decoding: still running when SIGTERM arrives
    request = pb.GenerateRequest(
        inputs="Once upon a time",
        parameters=pb.GenerateParameters(max_new_tokens=max_new, details=True),
    )
    with grpc.insecure_channel(deployment.target) as channel:
        stream = pb_grpc.TextGenerationStub(channel).GenerateStream(
            request, metadata=[("authorization", f"Bearer {API_KEY}")], timeout=120
        )
        events = [next(stream)]
        deployment.main.send_signal(signal.SIGTERM)
        # The router took the signal (health went NOT_SERVING) while the stream was still being
        # generated: the engine holds it as running.
        wait_until(
            lambda: health_status(deployment.target) == health_pb2.HealthCheckResponse.NOT_SERVING,
            timeout=10,
            interval=0.02,
            what="router NOT_SERVING after SIGTERM",
        )
        running = scrape(deployment.metrics_port)["tokenwire_running_requests"]
        assert running == 1, "the stream finished before SIGTERM: nothing was drained"
        events += list(stream)
    last = events[-1]
    assert last.HasField("generated_text") and not last.HasField("error"), last
    assert last.details.finish_reason == "length" and len(events) == max_new
    assert deployment.main.wait(60) == 0, deployment.log()
    assert "draining" in deployment.log()


def _children(pid: int) -> list[tuple[int, str]]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                out.append((int(entry.name), cmd))
        except (OSError, ValueError, IndexError):
            continue
    return out


@pytest.mark.slow
def test_killed_shard_tears_everything_down(tmp_path: Path) -> None:
    # Two tensor-parallel shards (gloo on CPU); rank 1 dies.
    dep = launch(tmp_path, "--num-shard", "2")
    try:
        children = _children(dep.main.pid)
        assert sum(" shard " in cmd for _, cmd in children) == 2, children
        shard = next(pid for pid, cmd in children if " shard " in cmd and "--rank 1" in cmd)
        body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 1000}}
        events = []
        for _, event in sse_events(dep.http_port, body, timeout=30):
            events.append(event)
            if len(events) == 3:
                os.kill(shard, signal.SIGKILL)
        # The SSE client learns in band that the stream failed.
        assert events[-1].get("error_type") in ("unavailable", "generation"), events[-1]
        code = dep.main.wait(30)
        assert code != 0
        assert "shard 1 exited with code -9" in dep.log(), dep.log()

        def gone(pid: int) -> bool:
            status = Path(f"/proc/{pid}/status")
            try:
                return "zombie" in status.read_text()
            except FileNotFoundError:
                return True

        wait_until(lambda: all(gone(pid) for pid, _ in children), timeout=5, what="children gone")
    finally:
        dep.stop(signal.SIGKILL)


def test_unknown_model_fails_fast_with_a_reason(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENWIRE_CACHE": str(tmp_path)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "service.app.cli",
            "launch",
            "--model-id",
            "org/does-not-exist",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=60,
    )
    assert result.returncode == 1
    assert "tokenwire launch: error:" in result.stderr, result.stderr


def test_a_limit_the_model_cannot_serve_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A flag checked against the model (here --max-total-tokens above max_position_embeddings)
    after the shards started: the router's one line naming the flag and the limit, exit 2, and no
    traceback, no "Task exception was never retrieved", no library noise at exit."""
    import subprocess
    import sys

    cache = tmp_path / "cache"
    model = launcher.ensure_tiny_model(cache)
    limit = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    for frontends in ("1", "2"):  # one process, and the scheduler process beside front ends
        result = subprocess.run(
            [sys.executable, "-m", "service.app.cli", "launch", "--model-id", str(model),
             "--port", "0", "--frontends", frontends, "--max-total-tokens", str(limit * 2)],
            capture_output=True, text=True, check=False, timeout=120,
            env={**os.environ, "TOKENWIRE_CACHE": str(cache)},
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
        assert errors == [
            f"tokenwire router: error: --max-total-tokens ({limit * 2}) must be <= the model's "
            f"max_position_embeddings ({limit})"
        ], result.stderr
        for noise in ("Traceback", "never retrieved", "leaked", "stopping everything"):
            assert noise not in result.stderr, result.stderr


def test_a_child_that_ignores_sigterm_during_startup_is_killed_within_seconds() -> None:
    """Stopping before the deployment was ready (Ctrl-C while shards load or warm up): a shard
    busy in a load or warm-up step only handles SIGTERM when that step ends, so the launcher gives
    every child a few seconds, not the 30 s a serving shard gets to write its profile."""
    import subprocess
    import sys
    import time

    stuck = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True);"
         " time.sleep(120)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert stuck.stdout is not None and stuck.stdout.readline()  # its handler is installed
    starting = launcher.Launcher(parse(["launch"]))
    starting.children.append(launcher.Child("shard 0", stuck))
    began = time.monotonic()
    starting.shutdown(graceful=True)
    assert stuck.poll() == -signal.SIGKILL
    assert time.monotonic() - began < launcher._STARTUP_STOP_S + 5


def test_a_signal_interrupts_the_launchers_own_startup_work() -> None:
    """SIGTERM while the launcher itself works (a GGUF conversion of tens of seconds) raises
    Interrupted in that work at once; after start-up it only requests the stop."""
    starting = launcher.Launcher(parse(["launch"]))
    starting.starting = True
    with pytest.raises(launcher.Interrupted):
        starting.on_signal(signal.SIGTERM, None)
    assert starting.stop_requested.is_set() and not starting.starting
    starting.on_signal(signal.SIGTERM, None)  # a second signal does not interrupt the shutdown


def test_router_front_ends_refuse_a_port_another_server_holds() -> None:
    """The front ends share --port through SO_REUSEPORT; a server already listening there (even
    one that set SO_REUSEPORT itself, as a second deployment's front ends do) is refused up front
    with one line and exit 2, not joined silently."""
    import socket
    import subprocess
    import sys

    from tests.helpers.ports import free_port

    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", port))
        other.listen()
        result = subprocess.run(
            [sys.executable, "-m", "service.app.cli", "router", "--hostname", "127.0.0.1",
             "--port", str(port), "--frontends", "2", "--shard-uds-path", "/nonexistent/shard",
             "--model-id", "unused"],
            capture_output=True, text=True, check=False, timeout=60,
        )  # fmt: skip
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"tokenwire router: error: --port {port}: 127.0.0.1:{port} is already in use "
                      "by another process"], result.stderr
