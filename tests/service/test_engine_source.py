"""service.app.serve.serve takes its engine, port sharing and cross-process admission as parameters
(what the multi-process router's front ends inject): no module attribute is patched."""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from tokenwire.v1 import generate_pb2 as pb
from tokenwire.v1 import generate_pb2_grpc

from service.app.engine_source import ShardConnection, ShardEngineSource
from service.app.remote_engine import SharedAdmission
from service.app.router_flags import add_arguments
from service.app.serve import serve
from service.testing import FakeShardConfig, start_fake_shard


class _CountingSource:
    """The default source, counting its calls: serve must use the one it is given."""

    def __init__(self, args: Any) -> None:
        self.inner = ShardEngineSource(args)
        self.calls: list[str] = []

    async def connect(self) -> ShardConnection:
        self.calls.append("connect")
        return await self.inner.connect()

    def build_engine(
        self, connection: Any, config: Any, on_unhealthy: Any, on_adapter_removed: Any = None
    ) -> Any:
        self.calls.append(f"build max_concurrent={config.max_concurrent_requests}")
        return self.inner.build_engine(connection, config, on_unhealthy, on_adapter_removed)


class _OneSlot:
    """An Admission that another process has filled but for one slot."""

    def __init__(self) -> None:
        self.taken = 0

    def try_enter(self) -> bool:
        if self.taken:
            return False
        self.taken += 1
        return True

    def leave(self) -> None:
        self.taken -= 1


def _args(shard_url: str, tokenizer_dir: Path) -> Any:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = f"--shard-address {shard_url} --tokenizer {tokenizer_dir} --port 0 "
    argv += (
        "--max-input-tokens 32 --max-total-tokens 64 --max-best-of 2 --max-concurrent-requests 4"
    )
    return parser.parse_args(argv.split())


async def test_serve_uses_the_injected_source_admission_and_reuse_port(
    tokenizer_dir: Path,
) -> None:
    shard_server, _, shard_url = await start_fake_shard(FakeShardConfig(num_blocks=64))
    args = _args(shard_url, tokenizer_dir)
    source, admission = _CountingSource(args), _OneSlot()
    stop = asyncio.Event()
    ports: asyncio.Queue[int] = asyncio.Queue()
    task = asyncio.ensure_future(
        serve(
            args,
            on_listening=ports.put_nowait,
            stop=stop,
            engine_source=source,
            reuse_port=True,
            admission=admission,
        )
    )
    try:
        port = await asyncio.wait_for(ports.get(), 10)
        # SO_REUSEPORT: another process (here a socket) may listen on the same port.
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            other.bind(("127.0.0.1", port))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generate_pb2_grpc.TextGenerationStub(channel)
            req = pb.GenerateRequest(
                inputs="hello", parameters=pb.GenerateParameters(max_new_tokens=3, details=True)
            )
            for _ in range(100):  # until warm
                try:
                    reply = await stub.Generate(req, timeout=5)
                    break
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                    await asyncio.sleep(0.05)
            assert reply.details.generated_tokens == 3
            assert admission.taken == 0  # left after the call
            admission.taken = 1  # the other front ends hold the rest of the global limit
            try:
                await stub.Generate(req, timeout=5)
                raise AssertionError("expected RESOURCE_EXHAUSTED")
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "--max-concurrent-requests" in (err.details() or "")
        assert source.calls == ["connect", "build max_concurrent=8"]  # 4 requests x best_of 2
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 20) == 0
        await shard_server.stop(None)


def test_shared_admission_is_one_limit_across_holders() -> None:
    counter = multiprocessing.get_context("spawn").Value("i", 0)
    a, b = SharedAdmission(counter, 3), SharedAdmission(counter, 3)
    assert [a.try_enter(), b.try_enter(), b.try_enter(), a.try_enter(), b.try_enter()] == [
        True, True, True, False, False,
    ]  # fmt: skip
    a.leave()
    assert b.try_enter() and not a.try_enter()
    assert counter.value == 3


@dataclass
class _Served:
    """A router `serve` runs in this loop, warm (health SERVING), and a channel to it."""

    channel: grpc.aio.Channel
    stop: asyncio.Event
    task: asyncio.Future[int]

    async def health(self) -> int:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.channel)
        return (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status

    async def generate_error(self, timeout: float) -> grpc.aio.AioRpcError:
        stub = generate_pb2_grpc.TextGenerationStub(self.channel)
        try:
            await stub.Generate(pb.GenerateRequest(inputs="hello"), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            return err
        raise AssertionError("expected the call to fail")


@asynccontextmanager
async def _warm_router(args: Any) -> AsyncIterator[_Served]:
    stop = asyncio.Event()
    ports: asyncio.Queue[int] = asyncio.Queue()
    task = asyncio.ensure_future(serve(args, on_listening=ports.put_nowait, stop=stop))
    try:
        port = await asyncio.wait_for(ports.get(), 10)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            served = _Served(channel, stop, task)
            for _ in range(200):  # until warm
                if await served.health() == 1:
                    break
                await asyncio.sleep(0.05)
            yield served
    finally:
        stop.set()
        if not task.done():
            await asyncio.wait_for(task, 20)


async def test_sigterm_refuses_reports_not_serving_and_stays_up_for_the_shutdown_delay(
    tokenizer_dir: Path,
) -> None:
    """On stop: new requests get UNAVAILABLE and health says NOT_SERVING at once, and with
    --shutdown-delay the server keeps answering health checks that long though nothing is in
    flight (a gateway polling health sees the drain, not a closed port)."""
    shard_server, _, shard_url = await start_fake_shard(FakeShardConfig(num_blocks=64))
    args = _args(shard_url, tokenizer_dir)
    args.shutdown_delay, args.graceful_timeout = 1.0, 5.0
    try:
        async with _warm_router(args) as served:
            loop = asyncio.get_running_loop()
            served.stop.set()
            stopped_at = loop.time()
            await asyncio.sleep(0.1)
            assert await served.health() == 2  # NOT_SERVING
            err = await served.generate_error(timeout=5)
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            await asyncio.sleep(0.6)
            assert not served.task.done()
            assert await served.health() == 2
            assert await asyncio.wait_for(served.task, 10) == 0
            assert loop.time() - stopped_at >= 1.0
    finally:
        await shard_server.stop(None)


async def test_a_step_over_shard_step_timeout_takes_the_shards_for_down(
    tokenizer_dir: Path,
) -> None:
    """A wedged shard answers no step: past --shard-step-timeout the request gets UNAVAILABLE
    and health turns NOT_SERVING, instead of the client waiting out the default 120 s."""
    shard_server, _, shard_url = await start_fake_shard(
        FakeShardConfig(num_blocks=64, step_delay_s=30.0)
    )
    args = _args(shard_url, tokenizer_dir)
    args.shard_step_timeout = 0.5
    try:
        async with _warm_router(args) as served:
            loop = asyncio.get_running_loop()
            started = loop.time()
            err = await served.generate_error(timeout=20)
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            assert loop.time() - started < 5.0
            assert await served.health() == 2  # NOT_SERVING
    finally:
        await shard_server.stop(None)


def test_shard_step_timeout_must_be_positive_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).shard_step_timeout == 120.0
    assert parser.parse_args(["--shard-step-timeout", "600"]).shard_step_timeout == 600.0
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--shard-step-timeout", bad])
        assert "--shard-step-timeout must be" in capsys.readouterr().err
