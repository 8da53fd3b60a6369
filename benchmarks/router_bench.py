"""Router benchmark: 256 concurrent streams against the instant fake shard.

Processes: the fake shard (service.testing, K/V checks off), the router (`tokenwire router`, the
real public gRPC API) and N load-client processes, each running its share of the streams in a
closed loop (a stream that finishes is replaced at once). Reports streamed tokens/s (one
GenerateStream message = one token), steps/s, mean batch size, and the router's CPU time per
step: the scheduler alone (schedule + apply_output), the engine step (plus proto conversion and
event dispatch), and the whole router process (gRPC streaming included).

    .venv/bin/python benchmarks/router_bench.py --streams 256 --clients 2 --duration 20
    .venv/bin/python benchmarks/router_bench.py --mode engine   # no public gRPC: engine + consumers

`--mode floor` replaces the router by a bare grpc.aio server streaming pre-built events: the
floor cost of a streamed message in one Python process, whatever the router does.
`--mode engine` runs the engine in this process with 256 consumer tasks reading the streams
directly (the fake shard still over gRPC in its own process): the router minus its front end,
plus, with `--router-detokenize on`, the router's text work (ids-only requests through
service.generation.text_stream, as a router with front ends runs them; needs `--tokenizer`).
The default, `auto`, is the router's own: no text work in this one process.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "gen" / "python")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and its live descendants (the multi-process router)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += _cpu_seconds(p)
        except OSError:
            continue
        todo.extend(children.get(p, []))
    return total


# --- fake shard process ------------------------------------------------------------------------
def _shard_main(port: int, num_blocks: int, block_size: int) -> None:
    from service.testing import FakeShardConfig, start_fake_shard

    async def main() -> None:
        cfg = FakeShardConfig(num_blocks=num_blocks, block_size=block_size, check_kv=False)
        server, _, _ = await start_fake_shard(cfg, f"127.0.0.1:{port}")
        await server.wait_for_termination()

    asyncio.run(main())


# --- load client process -------------------------------------------------------------------------
def _client_main(
    target: str, streams: int, max_new: int, warmup: float, duration: float, q
) -> None:
    import grpc
    from tokenwire.v1 import generate_pb2 as gpb
    from tokenwire.v1 import generate_pb2_grpc as ggrpc

    async def main() -> None:
        counts = {"tokens": 0, "requests": 0, "errors": 0}
        t_start = time.monotonic() + warmup
        t_end = t_start + duration
        async with grpc.aio.insecure_channel(target) as ch:
            stub = ggrpc.TextGenerationStub(ch)

            async def one(i: int) -> None:
                n = 0
                while time.monotonic() < t_end:
                    req = gpb.GenerateRequest(
                        inputs=f"stream {i} request {n} hello world",
                        parameters=gpb.GenerateParameters(max_new_tokens=max_new),
                    )
                    n += 1
                    try:
                        async for _ in stub.GenerateStream(req):
                            now = time.monotonic()
                            if t_start <= now < t_end:
                                counts["tokens"] += 1
                            elif now >= t_end:
                                break
                        counts["requests"] += 1
                    except grpc.aio.AioRpcError as e:
                        counts["errors"] += 1
                        if counts["errors"] < 3:
                            print("client error:", e.code(), e.details(), file=sys.stderr)
                        await asyncio.sleep(0.05)

            await asyncio.gather(*(one(i) for i in range(streams)))
        q.put(counts)

    asyncio.run(main())


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(tokenwire_[a-z_]+) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def run_grpc(args: argparse.Namespace) -> dict[str, float]:
    from tests.helpers.models import write_tokenizer_dir

    tmp = Path(tempfile.mkdtemp(prefix="router-bench-"))
    tok = Path(args.tokenizer) if args.tokenizer else write_tokenizer_dir(tmp / "tok")
    shard_port, router_port, prom_port = _free_port(), _free_port(), _free_port()
    ctx = mp.get_context("spawn")
    shard = ctx.Process(target=_shard_main, args=(shard_port, args.num_blocks, args.block_size))
    shard.start()
    router = subprocess.Popen(
        [
            sys.executable, *(["-m", "cProfile", "-o", args.profile_router] if args.profile_router else []),
            "-m", "service.app.cli", "router", "--frontends", str(max(args.frontends, 1)),
            "--shard-address", f"127.0.0.1:{shard_port}",
            "--tokenizer", str(tok),
            "--port", str(router_port),
            "--prometheus-port", str(prom_port),
            "--max-concurrent-requests", str(args.streams * 2),
            "--max-batch-size", str(args.streams),
            "--max-input-tokens", "1024",
            "--max-total-tokens", "2048",
            "--max-batch-prefill-tokens", "8192",
            "--waiting-served-ratio", str(args.waiting_served_ratio),
            "--log-level", "WARNING",
        ] + (["--no-overlap"] if args.no_overlap else [])
        + {"on": ["--router-detokenize"], "off": ["--no-router-detokenize"],
           "auto": []}[args.router_detokenize],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'gen' / 'python'}"},
    )  # fmt: skip
    try:
        _wait_serving(f"127.0.0.1:{router_port}", 60)
        if args.client == "h2load":
            return _grpc_h2load(args, f"127.0.0.1:{router_port}", prom_port, router, shard, tmp)
        q = ctx.Queue()
        per = [
            args.streams // args.clients + (i < args.streams % args.clients)
            for i in range(args.clients)
        ]
        clients = [
            ctx.Process(
                target=_client_main,
                args=(
                    f"127.0.0.1:{router_port}",
                    n,
                    args.max_new_tokens,
                    args.warmup,
                    args.duration,
                    q,
                ),
            )
            for n in per
        ]
        for c in clients:
            c.start()
        time.sleep(args.warmup)
        m0, r0, s0 = _scrape(prom_port), _tree_cpu_seconds(router.pid), _cpu_seconds(shard.pid)
        c0 = sum(_cpu_seconds(c.pid) for c in clients)
        t0 = time.monotonic()
        time.sleep(args.duration)
        m1, r1, s1 = _scrape(prom_port), _tree_cpu_seconds(router.pid), _cpu_seconds(shard.pid)
        c1 = sum(_cpu_seconds(c.pid) for c in clients)
        wall = time.monotonic() - t0
        results = [q.get(timeout=120) for _ in clients]
        for c in clients:
            c.join(30)
        tokens = sum(r["tokens"] for r in results)
        return _report(args, m0, m1, wall, tokens, r1 - r0, s1 - s0, c1 - c0,
                       sum(r["errors"] for r in results))  # fmt: skip
    finally:
        router.terminate()
        try:
            router.wait(15)
        except subprocess.TimeoutExpired:
            router.kill()
        shard.terminate()
        shard.join(5)


def _h2load_body(path: Path, max_new: int) -> bytes:
    """The gRPC-framed GenerateRequest h2load posts (flag 0, 4-byte big-endian length)."""
    from tokenwire.v1 import generate_pb2 as gpb

    msg = gpb.GenerateRequest(
        inputs="stream request hello world",
        parameters=gpb.GenerateParameters(max_new_tokens=max_new),
    ).SerializeToString()
    body = b"\x00" + len(msg).to_bytes(4, "big") + msg
    path.write_bytes(body)
    return body


def _sample_stream(target: str, max_new: int) -> tuple[int, int]:
    """One GenerateStream with h2load's request through a Python client: (messages, framed
    response bytes). Checks the router streams max_new tokens per request, and gives the bytes
    per request that cross-check h2load's data-byte count."""
    import grpc
    from tokenwire.v1 import generate_pb2 as gpb
    from tokenwire.v1 import generate_pb2_grpc as ggrpc

    with grpc.insecure_channel(target) as ch:
        stub = ggrpc.TextGenerationStub(ch)
        req = gpb.GenerateRequest(
            inputs="stream request hello world",
            parameters=gpb.GenerateParameters(max_new_tokens=max_new),
        )
        n = size = 0
        for m in stub.GenerateStream(req, timeout=60):
            assert not m.error, m.error
            n += 1
            size += 5 + m.ByteSize()
        return n, size


def _run_h2load(args, target: str, tmp: Path) -> tuple[subprocess.Popen, Path]:
    """Starts h2load (nghttp2-client, C): `clients` HTTP/2 connections with
    streams/clients concurrent GenerateStream calls each, closed loop, warm-up then a measured
    window. Not a test dependency: `apt-get install nghttp2-client`."""
    import shutil

    exe = shutil.which("h2load")
    if exe is None:
        raise SystemExit("--client h2load needs h2load: apt-get install -y nghttp2-client")
    body = tmp / "request.bin"
    _h2load_body(body, args.max_new_tokens)
    out = tmp / "h2load.out"
    per_conn = -(-args.streams // args.clients)
    cmd = [
        exe, "-c", str(args.clients), "-m", str(per_conn), "-t", "1",
        "-D", f"{int(args.duration)}", "--warm-up-time", f"{int(args.warmup)}",
        "-d", str(body),
        "-H", "content-type: application/grpc", "-H", "te: trailers",
        f"http://{target}/tokenwire.v1.TextGeneration/GenerateStream",
    ]  # fmt: skip
    with out.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    return proc, out


def _parse_h2load(text: str) -> dict[str, float]:
    m = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded", text)
    t = re.search(r"\((\d+)\) data", text)
    d = re.search(r"finished in ([0-9.]+)s", text)
    if not m:
        raise RuntimeError("cannot parse h2load output:\n" + text)
    return {
        "done": float(m.group(3)),
        "succeeded": float(m.group(4)),
        "data_bytes": float(t.group(1)) if t else 0.0,
        "finished_s": float(d.group(1)) if d else 0.0,
    }


def _wait_serving(target: str, timeout_s: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError("router did not become SERVING")


def _grpc_h2load(args, target, prom_port, router, shard, tmp) -> dict[str, float]:
    n, size = _sample_stream(target, args.max_new_tokens)
    if n != args.max_new_tokens:
        raise RuntimeError(f"sample stream sent {n} messages, expected {args.max_new_tokens}")
    proc, out = _run_h2load(args, target, tmp)
    time.sleep(args.warmup + 0.3)  # h2load's measured window starts after its warm-up
    m0, r0, s0, c0 = (
        _scrape(prom_port),
        _tree_cpu_seconds(router.pid),
        _cpu_seconds(shard.pid),
        _cpu_seconds(proc.pid),
    )
    root0 = _cpu_seconds(router.pid)
    t0 = time.monotonic()
    time.sleep(args.duration - 0.6)
    m1, r1, s1, c1 = (
        _scrape(prom_port),
        _tree_cpu_seconds(router.pid),
        _cpu_seconds(shard.pid),
        _cpu_seconds(proc.pid),
    )
    root1 = _cpu_seconds(router.pid)
    wall = time.monotonic() - t0
    proc.wait(args.duration + 120)
    h = _parse_h2load(out.read_text())
    # Steady closed loop: streamed tokens in the window = requests completed x max_new_tokens
    # (the fake shard always generates max_new_tokens; checked by the sample stream above).
    tokens_in_window = h["done"] * args.max_new_tokens / args.duration * wall
    res = _report(args, m0, m1, wall, tokens_in_window, r1 - r0, s1 - s0, c1 - c0, 0)  # fmt: skip
    if args.frontends > 1:  # the scheduler process alone (the rest is the front ends)
        res["scheduler_process_cpu_us_per_token"] = 1e6 * (root1 - root0) / max(tokens_in_window, 1)
        res["scheduler_process_cpu_cores"] = (root1 - root0) / wall
    res["h2load_requests_done"] = h["done"]
    res["h2load_requests_non2xx"] = h["done"] - h["succeeded"]
    # Cross-check over h2load's whole run (warm-up and ramp included, so a little lower).
    res["tokens_per_s_from_bytes_whole_run"] = (
        h["data_bytes"] / size * args.max_new_tokens / max(h["finished_s"], 1e-9)
    )
    res["bytes_per_request"] = size
    return res


def _report(
    args, m0, m1, wall, tokens, router_cpu, shard_cpu, client_cpu, errors
) -> dict[str, float]:
    def d(name: str) -> float:
        return m1.get(name, 0.0) - m0.get(name, 0.0)

    steps = d("tokenwire_engine_steps_total") or 1.0
    out = {
        "tokens_per_s": tokens / wall,
        "steps_per_s": steps / wall,
        "mean_batch": tokens / steps,
        "sched_cpu_ms_per_step": 1e3 * d("tokenwire_engine_scheduler_cpu_seconds_total") / steps,
        "engine_step_cpu_ms_per_step": 1e3 * d("tokenwire_engine_step_cpu_seconds_total") / steps,
        "router_process_cpu_ms_per_step": 1e3 * router_cpu / steps,
        "router_cpu_us_per_token": 1e6 * router_cpu / max(tokens, 1),
        "client_cpu_us_per_token": 1e6 * client_cpu / max(tokens, 1),
        "router_cpu_cores": router_cpu / wall,
        "shard_cpu_cores": shard_cpu / wall,
        "client_cpu_cores": client_cpu / wall,
        "errors": errors,
    }
    return out


# --- floor mode: grpc.aio streaming alone ---------------------------------------------------------------
def _floor_server_main(port: int, step_s: float) -> None:
    """A TextGeneration server that streams pre-built token events, paced like a batch step:
    every stream gets one event per `step_s` (0: as fast as grpc.aio goes). No engine, no
    validation: the floor cost of one streamed message in one Python process."""
    import grpc
    from tokenwire.v1 import generate_pb2 as gpb
    from tokenwire.v1 import generate_pb2_grpc as ggrpc

    class Floor(ggrpc.TextGenerationServicer):
        async def GenerateStream(self, request, context):
            n = request.parameters.max_new_tokens
            tok = gpb.Token(id=7, text=" t7", logprob=-0.5)
            for i in range(n):
                if step_s:
                    await asyncio.sleep(step_s)
                yield gpb.GenerateStreamResponse(index=i, token=tok)

    async def main() -> None:
        server = grpc.aio.server()
        ggrpc.add_TextGenerationServicer_to_server(Floor(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def run_floor(args: argparse.Namespace) -> dict[str, float]:
    port = _free_port()
    ctx = mp.get_context("spawn")
    server = ctx.Process(target=_floor_server_main, args=(port, 0.0))
    server.start()
    time.sleep(2.0)
    try:
        if args.client == "h2load":
            tmp = Path(tempfile.mkdtemp(prefix="router-bench-"))
            proc, out = _run_h2load(args, f"127.0.0.1:{port}", tmp)
            time.sleep(args.warmup + 0.3)
            r0, c0 = _cpu_seconds(server.pid), _cpu_seconds(proc.pid)
            t0 = time.monotonic()
            time.sleep(args.duration - 0.6)
            r1, c1 = _cpu_seconds(server.pid), _cpu_seconds(proc.pid)
            wall = time.monotonic() - t0
            proc.wait(args.duration + 120)
            h = _parse_h2load(out.read_text())
            tokens = h["done"] * args.max_new_tokens / args.duration * wall
            return {
                "tokens_per_s": tokens / wall,
                "server_cpu_us_per_token": 1e6 * (r1 - r0) / max(tokens, 1),
                "client_cpu_us_per_token": 1e6 * (c1 - c0) / max(tokens, 1),
                "server_cpu_cores": (r1 - r0) / wall,
                "client_cpu_cores": (c1 - c0) / wall,
            }
        q = ctx.Queue()
        per = [
            args.streams // args.clients + (i < args.streams % args.clients)
            for i in range(args.clients)
        ]
        clients = [
            ctx.Process(
                target=_client_main,
                args=(f"127.0.0.1:{port}", n, args.max_new_tokens, args.warmup, args.duration, q),
            )
            for n in per
        ]
        for c in clients:
            c.start()
        time.sleep(args.warmup)
        r0, c0 = _cpu_seconds(server.pid), sum(_cpu_seconds(c.pid) for c in clients)
        t0 = time.monotonic()
        time.sleep(args.duration)
        r1, c1 = _cpu_seconds(server.pid), sum(_cpu_seconds(c.pid) for c in clients)
        wall = time.monotonic() - t0
        results = [q.get(timeout=120) for _ in clients]
        tokens = sum(r["tokens"] for r in results)
        return {
            "tokens_per_s": tokens / wall,
            "server_cpu_us_per_token": 1e6 * (r1 - r0) / max(tokens, 1),
            "client_cpu_us_per_token": 1e6 * (c1 - c0) / max(tokens, 1),
            "server_cpu_cores": (r1 - r0) / wall,
            "client_cpu_cores": (c1 - c0) / wall,
        }
    finally:
        server.terminate()
        server.join(5)


# --- engine mode -----------------------------------------------------------------------------------
def run_engine(args: argparse.Namespace) -> dict[str, float]:
    from service.engine.backend import WarmupBudgets
    from service.engine.contracts import SamplingConfig, StoppingConfig, ValidatedRequest
    from service.engine.engine import EngineConfig, build_engine
    from service.shard_client.client import connect_and_warmup

    shard_port = _free_port()
    ctx = mp.get_context("spawn")
    shard = ctx.Process(target=_shard_main, args=(shard_port, args.num_blocks, args.block_size))
    shard.start()

    async def main() -> dict[str, float]:
        client, warm, _ = await connect_and_warmup(
            f"127.0.0.1:{shard_port}", WarmupBudgets(1024, 2048, 8192, args.streams)
        )
        engine = build_engine(
            client=client,
            warmup=warm,
            config=EngineConfig(
                max_concurrent_requests=args.streams * 2,
                max_batch_size=args.streams,
                max_batch_prefill_tokens=8192,
                waiting_served_ratio=args.waiting_served_ratio,
                overlap=not args.no_overlap,
            ),
        )
        await engine.start()
        # The router's text work (as GenerationService does it with front ends): ids-only
        # requests, detokenized and stop-matched by each consumer's TextStream. `auto` is the
        # one-process router's default: the shard makes the text.
        text = None
        if args.router_detokenize == "on":
            from tokenizers import Tokenizer

            from service.generation.text_stream import RouterText

            tok = Path(args.tokenizer) if args.tokenizer else None
            if tok is None:
                raise SystemExit("--mode engine --router-detokenize on: --tokenizer is needed")
            if tok.is_dir():
                tok = tok / "tokenizer.json"
            text = RouterText(Tokenizer.from_file(str(tok)))
        t_start = time.monotonic() + args.warmup
        t_end = t_start + args.duration
        count = [0]

        async def one(i: int) -> None:
            n = 0
            while time.monotonic() < t_end:
                prompt = tuple(range(i * 100 + n % 50, i * 100 + n % 50 + 12))
                n += 1
                req = ValidatedRequest(
                    request_id=str(i), input_ids=prompt, sampling=SamplingConfig(),
                    stopping=StoppingConfig(max_new_tokens=args.max_new_tokens,
                                            stop_sequences=tuple(args.stop)),
                    ids_only=text is not None,
                )  # fmt: skip
                stream = engine.submit(req)
                if text is not None:
                    stream = text.wrap(req, stream)
                async for _ in stream:
                    if t_start <= time.monotonic() < t_end:
                        count[0] += 1

        tasks = [asyncio.ensure_future(one(i)) for i in range(args.streams)]
        await asyncio.sleep(args.warmup)
        st0, p0 = engine.stats(), time.process_time()
        s0 = _cpu_seconds(shard.pid)
        t0 = time.monotonic()
        await asyncio.sleep(args.duration)
        st1, p1 = engine.stats(), time.process_time()
        s1 = _cpu_seconds(shard.pid)
        wall = time.monotonic() - t0
        await asyncio.gather(*tasks)
        await engine.stop()
        await client.close()
        m0 = {
            "tokenwire_engine_steps_total": st0.steps,
            **{f"tokenwire_engine_{k}": v for k, v in st0.extra.items()},
        }
        m1 = {
            "tokenwire_engine_steps_total": st1.steps,
            **{f"tokenwire_engine_{k}": v for k, v in st1.extra.items()},
        }
        return _report(args, m0, m1, wall, count[0], p1 - p0, s1 - s0, 0.0, 0)

    try:
        return asyncio.run(main())
    finally:
        shard.terminate()
        shard.join(5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["grpc", "engine", "floor"], default="grpc")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--clients", type=int, default=2, help="load-client processes")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--waiting-served-ratio", type=float, default=0.3)
    p.add_argument("--no-overlap", action="store_true",
                   help="the router's --no-overlap (one step at a time) for A/B")
    p.add_argument("--router-detokenize", choices=["auto", "on", "off"], default="auto",
                   help="who makes the text: the router's --router-detokenize / "
                   "--no-router-detokenize, or its default (auto: the router with front ends, "
                   "else the shard); --mode engine: on = each consumer runs the router's text "
                   "work, auto/off = the consumers read the engine's events as they are")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json or its directory for the router (default: the tiny "
                   "test tokenizer; a vocabulary of >= 32000 gives every fake token a text, "
                   "e.g. SmolLM2's)")
    p.add_argument("--stop", action="append", default=[],
                   help="a stop sequence of every request (repeatable; never matching keeps "
                   "max_new_tokens streams)")
    p.add_argument(
        "--client",
        choices=["python", "h2load"],
        default="python",
        help="load client: Python grpc.aio processes, or h2load (C, apt-get install nghttp2-client)",
    )
    p.add_argument(
        "--frontends",
        type=int,
        default=0,
        help="0 or 1: `tokenwire router` (one process); N >= 2: `tokenwire router --frontends N`, "
        "one scheduler process "
        "and N streaming front-end processes",
    )
    p.add_argument("--profile-router", help="write a cProfile of the router process here")
    args = p.parse_args()
    res = {"grpc": run_grpc, "engine": run_engine, "floor": run_floor}[args.mode](args)
    print(f"mode={args.mode} client={args.client} frontends={args.frontends} "
          f"streams={args.streams} clients={args.clients} "
          f"max_new_tokens={args.max_new_tokens} cpus={os.cpu_count()}")  # fmt: skip
    for k, v in res.items():
        print(f"  {k:32s} {v:12.3f}")


if __name__ == "__main__":
    main()
