"""`tokenwire router --frontends 2` (one scheduler process + streaming front-end processes, see
service/app/scheduler_process.py) against the fake shard: the public API behaves as the
one-process router does — streams equal unary answers, validation errors, cancellation frees every KV block, a dead
shard ends streams with UNAVAILABLE, --max-concurrent-requests is one global limit — and each
front end serves its request metrics on its own Prometheus port."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenwire.v1 import generate_pb2 as pb
from tokenwire.v1 import generate_pb2_grpc

from service.testing import FakeShardConfig, start_fake_shard
from tests.helpers.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]


def _gauge(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


async def _until(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def _deploy(
    tokenizer_dir: Path, *, max_concurrent: int, channels: int = 1, step_delay_s: float = 0.002
) -> AsyncIterator[tuple[Sequence[object], str, int, object]]:
    """The fake shard and `tokenwire router --frontends 2`; yields stubs over `channels`
    separate connections (SO_REUSEPORT spreads connections, not calls, over the front ends)."""
    cfg = FakeShardConfig(num_blocks=512, block_size=16, step_delay_s=step_delay_s)
    shard_server, _, shard_url = await start_fake_shard(cfg)
    port, prom = free_port(), free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220 - fixture setup
        [sys.executable, "-m", "service.app.cli", "router", "--frontends", "2",
         "--shard-address", shard_url, "--tokenizer", str(tokenizer_dir),
         "--port", str(port), "--prometheus-port", str(prom),
         "--max-input-tokens", "64", "--max-total-tokens", "256",
         "--max-concurrent-requests", str(max_concurrent), "--log-level", "WARNING"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'gen' / 'python'}"},
    )  # fmt: skip
    # A local subchannel pool per channel: one TCP connection each.
    opts = [("grpc.use_local_subchannel_pool", 1)]
    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) for _ in range(channels)]
    try:
        for chan in chans:  # every connection's front end is up
            health = health_pb2_grpc.HealthStub(chan)
            for _ in range(300):
                try:
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.1)
        stubs = [generate_pb2_grpc.TextGenerationStub(c) for c in chans]
        yield stubs, shard_url, prom, shard_server
    finally:
        for c in chans:
            await c.close()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        await shard_server.stop(None)


@pytest.fixture
async def deployment(tokenizer_dir: Path) -> AsyncIterator[tuple[object, str, int, object]]:
    # 5 ms a step: the "doomed" stream below must still be running when its shard stops, even
    # when a loaded machine starves this event loop for a while after its first token.
    async with _deploy(tokenizer_dir, max_concurrent=64, step_delay_s=0.005) as (
        stubs, shard_url, prom, shard
    ):
        yield stubs[0], shard_url, prom, shard


def _req(text: str, n: int, **kw: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(inputs=text, parameters=pb.GenerateParameters(max_new_tokens=n, **kw))


async def test_streams_match_unary_and_errors_map(deployment) -> None:  # type: ignore[no-untyped-def]
    stub, _, _, _ = deployment

    async def one(i: int) -> None:
        req = _req(
            f"hello world number {i}", 5 + i % 7, details=True, seed=i
        )  # the fake shard mixes the seed in
        events = [e async for e in stub.GenerateStream(req)]
        unary = await stub.Generate(req)
        assert [e.index for e in events] == list(range(len(events)))
        assert len(events) == 5 + i % 7
        text = "".join(e.token.text for e in events if not e.token.special)
        assert text == unary.generated_text == events[-1].generated_text
        assert events[-1].details.generated_tokens == len(events)

    await asyncio.gather(*(one(i) for i in range(48)))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Generate(_req("", 4))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.GenerateStream(_req("hi", 4, temperature=-1.0)):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in (err.value.details() or "")


async def test_cancel_half_frees_blocks_and_shard_death_is_unavailable(deployment) -> None:  # type: ignore[no-untyped-def]
    stub, _, prom, shard_server = deployment
    total = _gauge(prom, "tokenwire_kv_blocks_total")
    calls = [stub.GenerateStream(_req(f"stream {i} " * 3, 150)) for i in range(16)]
    firsts = [await c.read() for c in calls]
    assert all(f.index == 0 for f in firsts)
    for c in calls[::2]:
        c.cancel()
    for c in calls[1::2]:
        n = 1
        while (await c.read()) is not grpc.aio.EOF:
            n += 1
        assert n == 150
    await _until(lambda: _gauge(prom, "tokenwire_kv_blocks_free") == total, timeout=30.0)

    long = stub.GenerateStream(_req("doomed stream", 240))  # >= 1.2 s of steps
    await long.read()
    await shard_server.stop(None)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while (await long.read()) is not grpc.aio.EOF:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_max_concurrent_requests_is_global(tokenizer_dir: Path) -> None:
    limit = 8
    async with _deploy(tokenizer_dir, max_concurrent=limit, channels=16) as (stubs, _, prom, _):

        async def one(stub: object, i: int) -> str:
            try:
                n = 0
                async for _ in stub.GenerateStream(_req(f"busy {i}", 150)):  # type: ignore[attr-defined]
                    n += 1
                assert n == 150
                return "ok"
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                assert "--max-concurrent-requests" in (err.details() or "")
                return "refused"

        # 2x the limit at once, one call per connection (both front ends get some): the excess
        # is refused, the rest complete.
        results = await asyncio.gather(*(one(stubs[i], i) for i in range(2 * limit)))
        assert sorted(results) == ["ok"] * limit + ["refused"] * limit
        # Over ONE connection (one front end) the whole global limit is usable.
        results = await asyncio.gather(*(one(stubs[0], i) for i in range(2 * limit)))
        assert sorted(results) == ["ok"] * limit + ["refused"] * limit
        # Each front end serves its request metrics on PORT+i; together they saw every call.
        counts = [_counter_sum(prom + i, "tokenwire_request_count_total") for i in (1, 2)]
        assert sum(counts) == 4 * limit and all(c > 0 for c in counts), counts


def _counter_sum(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))
