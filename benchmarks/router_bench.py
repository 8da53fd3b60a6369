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
directly (the fake shard still over gRPC in its own process): the router minus its front end.
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
    tok = write_tokenizer_dir(tmp / "tok")
    shard_port, router_port, prom_port = _free_port(), _free_port(), _free_port()
    ctx = mp.get_context("spawn")
    shard = ctx.Process(target=_shard_main, args=(shard_port, args.num_blocks, args.block_size))
    shard.start()
    router = subprocess.Popen(
        [
            sys.executable, *(["-m", "cProfile", "-o", args.profile_router] if args.profile_router else []),
            "-m", "service.cli", "router",
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
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'gen' / 'python'}"},
    )  # fmt: skip
    try:
        _wait_serving(f"127.0.0.1:{router_port}", 60)
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
        m0, r0, s0 = _scrape(prom_port), _cpu_seconds(router.pid), _cpu_seconds(shard.pid)
        c0 = sum(_cpu_seconds(c.pid) for c in clients)
        t0 = time.monotonic()
        time.sleep(args.duration)
        m1, r1, s1 = _scrape(prom_port), _cpu_seconds(router.pid), _cpu_seconds(shard.pid)
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
    from service.engine import EngineConfig, build_engine
    from service.engine_api import SamplingConfig, StoppingConfig, ValidatedRequest
    from service.shard_client import connect_and_warmup
    from service.shard_convert import WarmupBudgets

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
            ),
        )
        await engine.start()
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
                    stopping=StoppingConfig(max_new_tokens=args.max_new_tokens),
                )  # fmt: skip
                async for _ in engine.submit(req):
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
    p.add_argument("--profile-router", help="write a cProfile of the router process here")
    args = p.parse_args()
    res = {"grpc": run_grpc, "engine": run_engine, "floor": run_floor}[args.mode](args)
    print(f"mode={args.mode} streams={args.streams} clients={args.clients} "
          f"max_new_tokens={args.max_new_tokens} cpus={os.cpu_count()}")  # fmt: skip
    for k, v in res.items():
        print(f"  {k:32s} {v:12.3f}")


if __name__ == "__main__":
    main()
