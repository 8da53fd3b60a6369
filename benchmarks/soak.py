"""Memory soak: N minutes of mixed load through Envoy, resident memory of every process sampled.

    python benchmarks/soak.py --minutes 30                  # one router process
    python benchmarks/soak.py --minutes 30 --frontends 2    # scheduler + 2 front-end processes

Starts `tokenwire launch` (embedded tiny model, CPU, every port a free one on 127.0.0.1), then
`--clients` threads loop over four kinds of request through Envoy's REST/SSE port until the time
is up: unary `POST /generate`, `POST /generate_stream` read to the end, a stream closed after its
first event (the router sees a cancellation), and an invalid request (400). Every prompt is new
(a counter in the text), the worst case for the router's caches. Every `--sample-s` seconds it
records the resident set size (RSS, /proc via psutil) of the router process(es), the shard and
Envoy, the request counts, and the router's bookkeeping sizes from its Prometheus endpoint
(`tokenwire_engine_requests_tracked`, `_deadline_entries`, `_prefix_cache_blocks`).

The report (stdout, and JSON lines in `--out`) gives, per process, RSS at the end of the warm-up
(`--warmup-s`, default 300 s), at the end, the growth in % and the growth per 1,000 requests after
warm-up (least-squares slope of RSS over requests completed). Everything stops by itself: the
clients at the deadline, the stack with SIGTERM (then SIGKILL of the launcher's group).
Run it under `nice` on a shared machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("unary", "stream", "stream_cancel", "invalid")
GAUGES = ("requests_tracked", "deadline_entries", "prefix_cache_blocks")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Counts:
    """Requests finished per kind, and the ones that did not end as expected."""

    done: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    failed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, ok: bool, error: str = "") -> None:
        with self.lock:
            self.done[kind] += 1
            if not ok:
                self.failed[kind] += 1
                if len(self.errors) < 20:
                    self.errors.append(f"{kind}: {error}")

    def total(self) -> int:
        with self.lock:
            return sum(self.done.values())


def _body(prompt: str, max_new_tokens: int) -> bytes:
    return json.dumps({"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}).encode()


def _prompt(client: int, i: int) -> str:
    # New text each request; a few lengths, so prompts span zero to several KV blocks.
    words = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")
    tail = " ".join(words[(i + k) % len(words)] for k in range(4 + (i % 5) * 6))
    return f"client {client} request {i}: {tail}"


def one_request(conn: http.client.HTTPConnection, kind: str, client: int, i: int) -> bool:
    """Runs one request of `kind` on `conn`; True when the connection may be reused."""
    headers = {"content-type": "application/json", "x-request-id": f"soak-{client}-{i}"}
    if kind == "unary":
        conn.request("POST", "/generate", _body(_prompt(client, i), 8), headers)
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200 or b"generated_text" not in data:
            raise RuntimeError(f"HTTP {resp.status}: {data[:200]!r}")
        return True
    if kind == "invalid":
        conn.request("POST", "/generate", _body("", 8), headers)  # empty inputs: 400
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 400:
            raise RuntimeError(f"expected 400, got {resp.status}: {data[:200]!r}")
        return True
    conn.request("POST", "/generate_stream", _body(_prompt(client, i), 12), headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    if kind == "stream_cancel":
        line = resp.readline()  # the first SSE event, then hang up: the router cancels
        if not line.startswith(b"data:"):
            raise RuntimeError(f"first stream line {line[:200]!r}")
        return False
    data = resp.read()
    if b"generated_text" not in data or b'"error"' in data:
        raise RuntimeError(f"stream ended without a final event: {data[-200:]!r}")
    return True


def client_loop(port: int, client: int, deadline: float, max_requests: int, counts: Counts) -> None:
    conn: http.client.HTTPConnection | None = None
    for i in range(max_requests):  # bounded: the deadline or max_requests, whichever first
        if time.monotonic() >= deadline:
            break
        kind = KINDS[(i + client) % len(KINDS)]
        if conn is None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            keep = one_request(conn, kind, client, i)
            counts.add(kind, True)
        except Exception as error:  # noqa: BLE001 - counted and reported, never fatal
            counts.add(kind, False, repr(error))
            keep = False
        if not keep:
            conn.close()
            conn = None
    if conn is not None:
        conn.close()


def classify(proc: psutil.Process) -> str | None:
    """Which component a process of the stack is."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return None
    text = " ".join(cmd)
    if cmd and "envoy" in Path(cmd[0]).name:
        return "envoy"
    if "service.app.cli shard" in text:
        return "shard"
    if "service.app.cli router" in text:
        return "router"
    if "multiprocessing" in text and "spawn_main" in text:
        return "router-child"  # --frontends N: scheduler / front-end processes
    return None


def components(launcher: psutil.Process) -> dict[str, psutil.Process]:
    """Named processes of the stack: router, router-1.. (its children), shard-0.., envoy."""
    out: dict[str, psutil.Process] = {}
    shards = 0
    router_children = 0
    for proc in sorted(launcher.children(recursive=True), key=lambda p: p.pid):
        kind = classify(proc)
        if kind == "shard":
            out[f"shard-{shards}"] = proc
            shards += 1
        elif kind == "router-child":
            router_children += 1
            out[f"router-{router_children}"] = proc
        elif kind is not None:
            out[kind] = proc
    return out


def scrape_gauges(port: int) -> dict[str, float]:
    """The router's bookkeeping gauges (scheduler process with --frontends N)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for name in GAUGES:
        m = re.search(rf"^tokenwire_engine_{name} ([0-9.e+]+)$", text, re.MULTILINE)
        if m:
            out[name] = float(m.group(1))
    return out


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def wait_ready(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"tokenwire launch exited with {proc.returncode}; see {log}")
        if "tokenwire launch: ready" in log.read_text(errors="replace"):
            return
        time.sleep(0.5)
    raise SystemExit(f"tokenwire launch not ready after {timeout_s} s; see {log}")


def stop_stack(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--warmup-s", type=float, default=300.0, help="growth is measured after this")
    p.add_argument("--sample-s", type=float, default=15.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-requests-per-client", type=int, default=10_000_000)
    p.add_argument("--frontends", type=int, default=1)
    p.add_argument("--cache-dir", type=Path, default=None, help="launcher's tiny-model cache")
    p.add_argument(
        "--model-id", default=None,
        help="the model to serve (default: the tiny random model, generated into the cache; "
        "the launcher's own default, SmolLM2, is ~50x slower per request on CPU)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="JSON lines: samples then summary")
    p.add_argument(
        "--launch-log", type=Path, default=None,
        help="the stack's output (request log lines: large); default /tmp/soak-launch-PID.log",
    )  # fmt: skip
    p.add_argument("launch_args", nargs="*", help="more `tokenwire launch` flags (after --)")
    args = p.parse_args()

    from service.app.launcher import cache_dir, ensure_tiny_model

    model_id = args.model_id or str(ensure_tiny_model(cache_dir(args.cache_dir)))
    grpc_port, http_port, admin_port, prom_port = (free_port() for _ in range(4))
    log = args.launch_log or Path(tempfile.gettempdir()) / f"soak-launch-{os.getpid()}.log"
    cmd = [
        sys.executable, "-m", "service.app.cli", "launch",
        "--hostname", "127.0.0.1", "--port", str(grpc_port),
        "--http-hostname", "127.0.0.1", "--http-port", str(http_port),
        "--envoy-admin-port", str(admin_port),
        "--prometheus-port", str(prom_port),
        "--frontends", str(args.frontends),
        "--model-id", model_id,
        *(["--cache-dir", str(args.cache_dir)] if args.cache_dir else []),
        *args.launch_args,
    ]  # fmt: skip
    env = dict(os.environ)
    env["PROMETHEUS_HOSTNAME"] = "127.0.0.1"  # the launcher has no flag for it
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "gen" / "python"), env.get("PYTHONPATH", "")]
    )
    out = args.out.open("w") if args.out else None

    def emit(record: dict[str, object]) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()

    emit(
        {
            "command": " ".join(sys.argv),
            "launch": " ".join(cmd),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "cpus": os.cpu_count(),
            "clients": args.clients,
        }
    )
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip
    samples: list[dict[str, object]] = []
    try:
        wait_ready(proc, log, 600)
        launcher = psutil.Process(proc.pid)
        procs = components(launcher)
        emit({"processes": {name: q.pid for name, q in procs.items()}})
        counts = Counts()
        t0 = time.monotonic()
        deadline = t0 + args.minutes * 60
        threads = [
            threading.Thread(
                target=client_loop,
                args=(http_port, c, deadline, args.max_requests_per_client, counts),
                daemon=True,
            )
            for c in range(args.clients)
        ]
        for t in threads:
            t.start()
        next_sample = t0
        while any(t.is_alive() for t in threads) or not samples:
            now = time.monotonic()
            if now >= next_sample:
                rss = {}
                for name, q in procs.items():
                    try:
                        rss[name] = q.memory_info().rss
                    except psutil.Error:
                        rss[name] = None
                record = {
                    "t": round(now - t0, 1), "requests": counts.total(),
                    "failed": sum(counts.failed.values()), "rss": rss,
                    "gauges": scrape_gauges(prom_port),
                }  # fmt: skip
                samples.append(record)
                emit(record)
                next_sample += args.sample_s
            if proc.poll() is not None:
                raise SystemExit(f"the stack exited with {proc.returncode}; see {log}")
            time.sleep(min(1.0, max(0.05, next_sample - time.monotonic())))
        for t in threads:
            t.join(5)
        # One last sample once idle: per-request bookkeeping must be back to zero.
        time.sleep(2)
        final = {
            "t": round(time.monotonic() - t0, 1), "requests": counts.total(),
            "failed": sum(counts.failed.values()),
            "rss": {n: q.memory_info().rss for n, q in procs.items()},
            "gauges": scrape_gauges(prom_port), "idle": True,
        }  # fmt: skip
        samples.append(final)
        emit(final)
        emit(summary(samples, args.warmup_s, counts))
    finally:
        stop_stack(proc)
        if out is not None:
            out.close()
    return 0


def summary(samples: list[dict[str, object]], warmup_s: float, counts: Counts) -> dict[str, object]:
    after = [s for s in samples if float(s["t"]) >= warmup_s and not s.get("idle")]  # type: ignore[arg-type]
    report: dict[str, object] = {
        "requests": dict(counts.done),
        "failed": dict(counts.failed),
        "errors": counts.errors,
        "duration_s": samples[-1]["t"],
    }
    if len(after) < 2:
        report["note"] = "too few samples after warm-up for growth figures"
        return report
    first, last = after[0], after[-1]
    reqs = [float(s["requests"]) for s in after]  # type: ignore[arg-type]
    growth: dict[str, object] = {}
    for name in first["rss"]:  # type: ignore[union-attr]
        ys = [float(s["rss"][name]) for s in after]  # type: ignore[index]
        a, b = ys[0], ys[-1]
        growth[name] = {
            "rss_after_warmup_mib": round(a / 2**20, 2),
            "rss_end_mib": round(b / 2**20, 2),
            "rss_max_mib": round(max(ys) / 2**20, 2),
            "growth_pct": round(100 * (b - a) / a, 2),
            "bytes_per_1000_requests": round(1000 * slope(reqs, ys)),
        }
    report["after_warmup"] = {
        "from_t": first["t"], "to_t": last["t"],
        "requests": int(reqs[-1] - reqs[0]), "processes": growth,
    }  # fmt: skip
    return report


if __name__ == "__main__":
    sys.exit(main())
