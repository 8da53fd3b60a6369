"""service.frontend (one scheduler process + streaming front-end processes) against the fake shard:
the public API behaves as `tokenwire router` does — streams equal unary answers, validation
errors, cancellation frees every KV block, a dead shard ends streams with UNAVAILABLE."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
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


@pytest.fixture
async def deployment(tokenizer_dir: Path) -> AsyncIterator[tuple[object, str, int, object]]:
    cfg = FakeShardConfig(num_blocks=512, block_size=16, step_delay_s=0.002)
    shard_server, _, shard_url = await start_fake_shard(cfg)
    port, prom = free_port(), free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220 - fixture setup
        [sys.executable, "-m", "service.frontend", "--frontends", "2",
         "--shard-address", shard_url, "--tokenizer", str(tokenizer_dir),
         "--port", str(port), "--prometheus-port", str(prom),
         "--max-input-tokens", "64", "--max-total-tokens", "256",
         "--max-concurrent-requests", "64", "--log-level", "WARNING"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'gen' / 'python'}"},
    )  # fmt: skip
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(300):
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
        yield generate_pb2_grpc.TextGenerationStub(channel), shard_url, prom, shard_server
    finally:
        await channel.close()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        await shard_server.stop(None)


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
    await _until(lambda: _gauge(prom, "tokenwire_kv_blocks_free") == total)

    long = stub.GenerateStream(_req("doomed stream", 200))
    await long.read()
    await shard_server.stop(None)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while (await long.read()) is not grpc.aio.EOF:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
