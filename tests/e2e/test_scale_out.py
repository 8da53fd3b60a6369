"""Scale-out acceptance (issue 26), all real: `tokenwire launch --replicas 3` (tiny model, three
shard + router pairs) behind the real Envoy with the endpoint picker, on loopback.

- Prefix affinity: 400 requests drawn from 8 long shared system prompts reach, per the replicas'
  own metrics, at least twice round-robin's prefix-cache hit rate (round-robin: a second
  `tokenwire gateway --no-picker --lb-policy round_robin` over the same replicas, with a
  disjoint set of prompts), and no replica gets more than 1.5x its share.
- Tracing: an in-process OTLP receiver gets one connected trace per request, with spans from
  Envoy, the router and the shard, the client's traceparent as the root's parent.
- SIGKILL of one replica's shard under load: requests that had received nothing are retried and
  succeed, streams already running end with an in-band error, Envoy ejects the replica within
  5 s, nothing hangs.
- SIGTERM of one replica: it drains (new requests go elsewhere, its streams finish).

The KV cache of each replica is kept small (KV_TOKENS) so that it holds about three of the eight
prompts: round-robin makes every replica cycle through all eight (LRU misses), the picker keeps
each prompt on one replica. The tests share one deployment and run in order (kill and drain
each take a replica away).
"""

from __future__ import annotations

import json
import random
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from tokenwire.v1 import generate_pb2 as pb
from tokenwire.v1 import generate_pb2_grpc as pb_grpc

from service.app.gateway import envoy_binary
from service.app.launcher import ensure_tiny_model
from tests.helpers.metrics import scrape
from tests.helpers.ports import free_port
from tests.helpers.processes import (
    Deployment,
    ManagedProcess,
    quiet_env,
    run_checked,
    tokenwire_argv,
    wait_ready,
)

# Out of quarantine since the causes of its flakes were fixed in the product (issue 26): Envoy's
# retry circuit breaker dropped retries when the killed replica failed more than 3 requests at
# once (now as many as requests); the router left before Envoy's two health checks saw
# NOT_SERVING (now --shutdown-delay, and the test waits on Envoy's flag); prompts moved between
# replicas on noisy guards (now one home per prefix, spills not recorded).
pytestmark = [pytest.mark.slow]

REPLICAS = 3
KV_TOKENS = 1536  # 96 blocks of 16 per replica: about 3 of the 8 system prompts
N_PROMPTS = 8
N_REQUESTS = 400
CONCURRENCY = 6
WORDS = (
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
)


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector in the test process: keeps every span it receives."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[str, object]] = []  # (service.name, Span)

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for scope in resource_spans.scope_spans:
                    self.spans.extend((service, s) for s in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: bytes) -> list[tuple[str, object]]:
        with self.lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id == trace_id]


@dataclass
class Pool:
    deployment: Deployment
    round_robin: ManagedProcess
    rr_port: int
    admin_port: int
    receiver: OtlpReceiver
    tmp: Path
    metrics_ports: list[int] = field(default_factory=list)

    @property
    def ports(self) -> list[int]:
        return [self.deployment.port + i for i in range(REPLICAS)]

    def replica_launcher(self, i: int) -> psutil.Process:
        port = str(self.ports[i])
        for child in psutil.Process(self.deployment.main.pid).children():
            cmd = command_line(child)
            if "launch" in cmd and port in cmd:
                return child
        raise AssertionError(f"replica {i} not found")

    def replica_process(self, i: int, role: str) -> psutil.Process:
        for child in self.replica_launcher(i).children():
            if role in command_line(child):
                return child
        raise AssertionError(f"replica {i} has no {role}")


def command_line(process: psutil.Process) -> list[str]:
    """Its command line; [] for one that has exited (a replica stopped by an earlier test may
    still be a zombie until its launcher reaps it)."""
    try:
        return process.cmdline()
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return []


def consecutive_free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free (replica i listens on p + i)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000)  # below the ephemeral range
        sockets = []
        try:
            for i in range(n):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("", base + i))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise AssertionError("no run of free ports")


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("scale")
    receiver = OtlpReceiver()
    collector = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, collector)
    otlp_port = collector.add_insecure_port("127.0.0.1:0")
    collector.start()
    admin, http_port = free_port(), free_port()
    port, metrics_port = consecutive_free_ports(REPLICAS), consecutive_free_ports(REPLICAS)
    cache = tmp.parent / "tokenwire-cache"
    process = ManagedProcess(
        "launch",
        tokenwire_argv(
            "launch",
            "--replicas",
            str(REPLICAS),
            "--model-id",
            str(ensure_tiny_model(cache)),
            "--port",
            str(port),
            "--prometheus-port",
            str(metrics_port),
            "--http-port",
            str(http_port),
            "--http-hostname",
            "127.0.0.1",
            "--envoy-admin-port",
            str(admin),
            "--max-batch-total-tokens",
            str(KV_TOKENS),
            "--max-total-tokens",
            "640",
            "--max-input-tokens",
            "620",
            "--max-batch-prefill-tokens",
            "1024",
            "--graceful-timeout",
            "20",
            "--otlp-endpoint",
            f"127.0.0.1:{otlp_port}",
        ),
        tmp / "launch.log",
        env=quiet_env({"TOKENWIRE_CACHE": str(cache)}),
    ).start()
    deployment = Deployment([process], port, metrics_port, http_port)
    try:
        wait_ready(
            lambda: "replicas behind the gateway" in process.log(), [process], 240, "replicas"
        )
    except BaseException:
        deployment.stop(signal.SIGKILL)
        collector.stop(0)
        raise
    rr_port, rr_admin = free_port(), free_port()
    backends = ",".join(
        f"127.0.0.1:{deployment.port + i}/{deployment.metrics_port + i}" for i in range(REPLICAS)
    )
    rr = ManagedProcess(
        "gateway-rr",
        tokenwire_argv(
            "gateway",
            "--backends",
            backends,
            "--no-picker",
            "--lb-policy",
            "round_robin",
            "--http-port",
            str(rr_port),
            "--http-hostname",
            "127.0.0.1",
            "--admin-port",
            str(rr_admin),
        ),
        tmp / "gateway-rr.log",
    ).start()
    pool = Pool(deployment, rr, rr_port, admin, receiver, tmp)
    try:
        wait_ready(lambda: "tokenwire gateway: ready" in rr.log(), [rr], 60, "gateway ready")
        # Both gateways route to every replica from the first request on: Envoy sends nothing
        # to a replica before its first health check passed.
        wait_ready(
            lambda: all(
                host_health(a, p) == "healthy" for a in (admin, rr_admin) for p in pool.ports
            ),
            [process, rr],
            20,
            "every replica healthy in both gateways",
        )
        yield pool
    finally:
        rr.stop()
        deployment.stop(timeout=60)
        collector.stop(0)


def system_prompts(seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"System {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(80)) + "\n"
        for i in range(N_PROMPTS)
    ]


def replica_counters(pool: Pool) -> list[dict[str, float]]:
    out = []
    for i in range(REPLICAS):
        s = scrape(pool.deployment.metrics_port + i)
        out.append(
            {
                "hit": s.total("tokenwire_prefix_cache_hit_tokens_total"),
                "computed": s.total("tokenwire_prefill_tokens_computed_total"),
                "requests": s.total("tokenwire_request_success_total"),
            }
        )
    return out


def run_workload(port: int, prompts: list[str], seed: int) -> dict[str, object]:
    """N_REQUESTS unary Generate calls through the gateway at port, CONCURRENCY at a time."""
    rng = random.Random(seed)
    inputs = [
        rng.choice(prompts) + f"User question {k}: {rng.choice(WORDS)} {rng.choice(WORDS)}?"
        for k in range(N_REQUESTS)
    ]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.TextGenerationStub(channel)

        def one(text: str) -> None:
            stub.Generate(
                pb.GenerateRequest(inputs=text, parameters=pb.GenerateParameters(max_new_tokens=2)),
                timeout=60,
            )

        with futures.ThreadPoolExecutor(CONCURRENCY) as executor:
            list(executor.map(one, inputs))
    return {"requests": N_REQUESTS}


def measure(pool: Pool, port: int, seed: int) -> tuple[float, list[float]]:
    before = replica_counters(pool)
    started = time.monotonic()
    run_workload(port, system_prompts(seed), seed)
    elapsed = time.monotonic() - started
    after = replica_counters(pool)
    hit = sum(a["hit"] - b["hit"] for a, b in zip(after, before, strict=True))
    computed = sum(a["computed"] - b["computed"] for a, b in zip(after, before, strict=True))
    shares = [a["requests"] - b["requests"] for a, b in zip(after, before, strict=True)]
    rate = hit / (hit + computed)
    print(f"port {port}: hit rate {rate:.3f}, requests per replica {shares}, {elapsed:.1f} s")
    return rate, shares


def test_picker_doubles_the_prefix_cache_hit_rate_of_round_robin(pool: Pool) -> None:
    rr_rate, rr_shares = measure(pool, pool.rr_port, seed=1)
    picker_rate, shares = measure(pool, pool.deployment.http_port, seed=2)
    (pool.tmp / "hit_rates.json").write_text(
        json.dumps(
            {
                "round_robin": rr_rate,
                "picker": picker_rate,
                "rr_shares": rr_shares,
                "picker_shares": shares,
            }
        )
    )
    assert sum(shares) == N_REQUESTS and sum(rr_shares) == N_REQUESTS
    assert picker_rate >= 2 * rr_rate, (picker_rate, rr_rate)
    assert max(shares) <= 1.5 * N_REQUESTS / REPLICAS, shares


# --- tracing -------------------------------------------------------------------------------------


def test_one_connected_trace_per_request_from_envoy_router_and_shard(pool: Pool) -> None:
    rng = random.Random(7)
    traces = []
    with grpc.insecure_channel(f"127.0.0.1:{pool.deployment.http_port}") as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        for k in range(3):
            trace_id, parent = rng.getrandbits(128), rng.getrandbits(64)
            traceparent = f"00-{trace_id:032x}-{parent:016x}-01"
            request = pb.GenerateRequest(
                inputs=f"trace me {k} " * 20, parameters=pb.GenerateParameters(max_new_tokens=3)
            )
            metadata = (("traceparent", traceparent), ("x-request-id", f"traced-{k}"))
            if k == 0:
                list(stub.GenerateStream(request, metadata=metadata, timeout=30))
            else:
                stub.Generate(request, metadata=metadata, timeout=30)
            traces.append((trace_id.to_bytes(16, "big"), parent.to_bytes(8, "big"), f"traced-{k}"))
    services = {"tokenwire.gateway", "tokenwire.router", "tokenwire.shard"}
    deadline = time.monotonic() + 20
    for trace_id, parent, request_id in traces:
        while True:
            spans = pool.receiver.trace(trace_id)
            seen = {svc for svc, _ in spans}
            if (
                services <= seen
                and any(s.name == "decode" for _, s in spans)
                or (time.monotonic() > deadline)
            ):
                break
            time.sleep(0.2)
        assert services <= seen, (seen, [(svc, s.name) for svc, s in spans])
        ids = {s.span_id for _, s in spans}
        roots = [s for _, s in spans if s.parent_span_id not in ids]
        # Connected: every span hangs off another span of the trace, but one, whose parent is
        # the client's span, and that one is Envoy's.
        assert [s.parent_span_id for s in roots] == [parent], [
            (s.name, s.parent_span_id) for s in roots
        ]
        root_service = next(svc for svc, s in spans if s is roots[0])
        assert root_service == "tokenwire.gateway"
        names = {(svc, s.name) for svc, s in spans}
        for phase in ("validate", "queue", "prefill"):
            assert ("tokenwire.router", phase) in names, names
        assert ("tokenwire.shard", "Prefill") in names, names
        request_spans = [
            s for svc, s in spans if svc == "tokenwire.router" and s.name.startswith("tokenwire.")
        ]
        attrs = {a.key: a.value.string_value for a in request_spans[0].attributes}
        assert attrs["tokenwire.request_id"] == request_id
        shard_attrs = [
            {a.key: a.value.int_value for a in s.attributes}
            for svc, s in spans
            if svc == "tokenwire.shard"
        ]
        assert all(a["tokenwire.batch_size"] >= 1 for a in shard_attrs)


def test_without_the_picker_envoy_balances_by_least_request(pool: Pool) -> None:
    """`tokenwire gateway --no-picker` (Envoy's least-request, the default policy) over the same
    replicas: every request succeeds and every replica takes a part."""
    port, admin = free_port(), free_port()
    backends = ",".join(
        f"127.0.0.1:{pool.deployment.port + i}/{pool.deployment.metrics_port + i}"
        for i in range(REPLICAS)
    )
    gateway = ManagedProcess(
        "gateway-lr",
        tokenwire_argv(
            "gateway", "--backends", backends, "--no-picker", "--http-port", str(port),
            "--http-hostname", "127.0.0.1", "--admin-port", str(admin),
        ),
        pool.tmp / "gateway-lr.log",
    ).start()  # fmt: skip
    try:
        wait_ready(lambda: "tokenwire gateway: ready" in gateway.log(), [gateway], 60, "ready")
        # Envoy sends nothing to a replica before its first health check passed.
        wait_ready(
            lambda: all(host_health(admin, p) == "healthy" for p in pool.ports),
            [gateway],
            20,
            "every replica healthy in Envoy",
        )
        before = replica_counters(pool)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.TextGenerationStub(channel)
            request = pb.GenerateRequest(
                inputs="least request " * 10, parameters=pb.GenerateParameters(max_new_tokens=8)
            )
            with futures.ThreadPoolExecutor(6) as executor:
                list(executor.map(lambda _: stub.Generate(request, timeout=30), range(30)))
        after = replica_counters(pool)
        served = [a["requests"] - b["requests"] for a, b in zip(after, before, strict=True)]
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/clusters", timeout=2) as r:
            hosts = [
                line for line in r.read().decode().splitlines() if "tokenwire_router::" in line
            ]
        (pool.tmp / "least_request_hosts.txt").write_text("\n".join(hosts))
        assert sum(served) == 30 and min(served) > 0, (served, hosts)
    finally:
        gateway.stop()


# --- failures ------------------------------------------------------------------------------------


@dataclass
class StreamOutcome:
    events: int = 0
    finished: bool = False
    in_band_error: str | None = None
    status: grpc.StatusCode | None = None
    started: float = 0.0
    ended: float = 0.0


def stream_once(stub: pb_grpc.TextGenerationStub, text: str, max_new_tokens: int) -> StreamOutcome:
    outcome = StreamOutcome(started=time.monotonic())
    request = pb.GenerateRequest(
        inputs=text, parameters=pb.GenerateParameters(max_new_tokens=max_new_tokens)
    )
    try:
        for event in stub.GenerateStream(request, timeout=60):
            if event.HasField("error"):
                outcome.in_band_error = event.error
                continue
            outcome.events += 1
            if event.HasField("details") or event.HasField("generated_text"):
                outcome.finished = True
    except grpc.RpcError as error:
        outcome.status = error.code()
    outcome.ended = time.monotonic()
    return outcome


def load(port: int, stop: threading.Event, outcomes: list[StreamOutcome], max_new_tokens: int,
         streams: int) -> list[threading.Thread]:  # fmt: skip
    """`streams` client threads, each streaming one request after another until `stop`."""

    def client(k: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.TextGenerationStub(channel)
            n = 0
            while not stop.is_set():
                outcomes.append(stream_once(stub, f"client {k} request {n} " * 6, max_new_tokens))
                n += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(streams)]
    for t in threads:
        t.start()
    return threads


def host_health(admin_port: int, port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/clusters", timeout=2) as r:
        text = r.read().decode()
    prefix = f"tokenwire_router::127.0.0.1:{port}::health_flags::"
    for line in text.splitlines():
        if line.startswith(prefix):
            return line.removeprefix(prefix)
    return "absent"


def envoy_stats(admin_port: int) -> str:
    """Envoy's counters for the router cluster (retries, overflows, ejections), for post-mortems."""
    url = f"http://127.0.0.1:{admin_port}/stats?filter=tokenwire_router"
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.read().decode()


def test_sigkill_of_a_replica_under_load_retries_and_ejects_it(pool: Pool) -> None:
    victim = 0
    assert host_health(pool.admin_port, pool.ports[victim]) == "healthy"
    outcomes: list[StreamOutcome] = []
    stop = threading.Event()
    threads = load(pool.deployment.http_port, stop, outcomes, 120, streams=9)
    time.sleep(2.0)
    shard = pool.replica_process(victim, "shard")
    killed_at = time.monotonic()
    shard.send_signal(signal.SIGKILL)
    ejected_after = None
    while time.monotonic() - killed_at < 10:
        if host_health(pool.admin_port, pool.ports[victim]) != "healthy":
            ejected_after = time.monotonic() - killed_at
            break
        time.sleep(0.05)
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a client hung"
    (pool.tmp / "ejection.json").write_text(json.dumps({"ejected_after_s": ejected_after}))
    stats = envoy_stats(pool.admin_port)
    (pool.tmp / "envoy_stats_kill.txt").write_text(stats)
    (pool.tmp / "outcomes_kill.txt").write_text(
        "\n".join(f"{o.started - killed_at:+.3f} {o.ended - killed_at:+.3f} {o}" for o in outcomes)
    )
    print(f"ejected after {ejected_after} s; {len(outcomes)} streams")
    assert ejected_after is not None and ejected_after <= 5.0, ejected_after
    # Every retry Envoy wanted to make was made (none refused by its retry circuit breaker).
    assert "cluster.tokenwire_router.upstream_rq_retry_overflow: 0\n" in stats, stats
    failed = [o for o in outcomes if not o.finished]
    # Nothing that had not received a byte failed: it was retried on another replica.
    assert not [o for o in failed if o.events == 0], failed
    # Streams cut after their first event say so in band, then end with UNAVAILABLE.
    assert all(o.in_band_error and o.status == grpc.StatusCode.UNAVAILABLE for o in failed), failed
    around_kill = [o for o in outcomes if o.started <= killed_at <= o.ended]
    assert around_kill, "no stream was running at the kill"
    assert len(outcomes) > len(failed)


def not_serving_after(port: int, since: float, deadline: float) -> float | None:
    """Seconds from `since` until the replica's own metrics say it is not serving (it refuses
    new requests from then on); None if its metrics server went away first or the deadline."""
    while time.monotonic() < deadline:
        try:
            if scrape(port).total("tokenwire_serving") == 0.0:
                return time.monotonic() - since
        except OSError:
            return None
        time.sleep(0.02)
    return None


def test_sigterm_drains_a_replica(pool: Pool) -> None:
    victim = 1
    replica = pool.replica_launcher(victim)
    router = pool.replica_process(victim, "router")
    outcomes: list[StreamOutcome] = []
    stop = threading.Event()
    threads = load(pool.deployment.http_port, stop, outcomes, 60, streams=6)
    time.sleep(1.5)
    termed_at = time.monotonic()
    replica.send_signal(signal.SIGTERM)
    refusing_after = not_serving_after(
        pool.deployment.metrics_port + victim, termed_at, termed_at + 5.0
    )
    # Envoy takes it out of the rotation on its health check's NOT_SERVING.
    ejected_after = None
    while time.monotonic() - termed_at < 5.0:
        if host_health(pool.admin_port, pool.ports[victim]) != "healthy":
            ejected_after = time.monotonic() - termed_at
            break
        time.sleep(0.02)
    router.wait(40)
    exited_after = time.monotonic() - termed_at
    # Keep the load on until a few streams started after the victim was gone.
    deadline = time.monotonic() + 30
    while (
        sum(o.started > termed_at + exited_after for o in outcomes) < 6
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a client hung"
    (pool.tmp / "drain.json").write_text(
        json.dumps(
            {
                "not_serving_after_s": refusing_after,
                "ejected_after_s": ejected_after,
                "router_exited_after_s": exited_after,
                "streams": len(outcomes),
            }
        )
    )
    print(
        f"drain: NOT_SERVING after {refusing_after} s, ejected after {ejected_after} s, "
        f"router exited after {exited_after:.2f} s; {len(outcomes)} streams"
    )
    assert refusing_after is not None and refusing_after < 1.0, refusing_after
    assert ejected_after is not None, "the draining replica was never taken out of rotation"
    # Every stream finished: those running on the victim drained, new ones went elsewhere.
    assert [o for o in outcomes if not o.finished] == []
    assert any(o.started < termed_at < o.ended for o in outcomes)
    assert sum(o.started > termed_at + exited_after for o in outcomes) >= 6
    # The replica drained and stopped cleanly; the deployment goes on with the one left.
    replica.wait(60)
    line = f"replica {victim} exited with code 0"
    deadline = time.monotonic() + 10
    while line not in pool.deployment.main.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert line in pool.deployment.main.log()
    assert pool.deployment.main.alive


def test_gateway_config_is_accepted_by_envoy(tmp_path: Path) -> None:
    """`tokenwire gateway --print-config` passes Envoy's own validation, with the picker and
    tracing, and without the picker (Envoy's least-request, no ext_proc)."""
    ips, names = "127.0.0.1:50051/9000,127.0.0.1:50052/9001", "localhost:50051/9000"
    for name, backends, extra in (
        ("picker", ips, ["--otlp-endpoint", "127.0.0.1:4317"]),
        ("no-picker", ips, ["--no-picker"]),
        ("host names", names, []),
    ):
        out = run_checked(
            tokenwire_argv("gateway", "--backends", backends, *extra, "--print-config")
        )
        config = tmp_path / f"envoy-{name.replace(' ', '-')}.json"
        config.write_text(out.stdout)
        rendered = json.loads(out.stdout)
        cluster = next(
            c for c in rendered["static_resources"]["clusters"] if c["name"] == "tokenwire_router"
        )
        # A dying replica's queued requests all fail at once: each may be retried elsewhere.
        (threshold,) = cluster["circuit_breakers"]["thresholds"]
        assert threshold["max_retries"] == threshold["max_requests"] >= 1024
        # Addresses: a STATIC cluster (each replica routable once healthy); names: resolved.
        assert cluster["type"] == ("STRICT_DNS" if name == "host names" else "STATIC")
        policy = json.dumps(cluster["load_balancing_policy"])
        filters = json.dumps(rendered["static_resources"]["listeners"])
        if name == "no-picker":
            assert "override_host" not in policy and "least_request" in policy
            assert "ext_proc" not in filters
        else:
            assert "override_host" in policy and "ext_proc" in filters
        run_checked([envoy_binary(), "--mode", "validate", "-c", config, "--disable-hot-restart"])
