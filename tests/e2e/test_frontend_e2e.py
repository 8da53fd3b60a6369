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
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenwire.v1 import generate_pb2 as pb
from google.api.httpbody_pb2 import HttpBody
from prometheus_client.parser import text_string_to_metric_families
from tokenwire.v1 import generate_pb2_grpc, tgi_pb2_grpc

from service.testing import FakeShard, FakeShardConfig, start_fake_shard
from tests.helpers.metrics import scrape, scrape_when_up
from tests.helpers.ports import free_port
from tests.helpers.processes import terminate_popen
from tests.helpers.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]


@contextlib.asynccontextmanager
async def _deploy(
    tokenizer_dir: Path, *, max_concurrent: int, channels: int = 1, step_delay_s: float = 0.002
) -> AsyncIterator[tuple[Sequence[object], FakeShard, int, object]]:
    """The fake shard and `tokenwire router --frontends 2`; yields stubs over `channels`
    separate connections (SO_REUSEPORT spreads connections, not calls, over the front ends)."""
    cfg = FakeShardConfig(num_blocks=512, block_size=16, step_delay_s=step_delay_s)
    shard_server, fake, shard_url = await start_fake_shard(cfg)
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
        _channels[id(stubs[0])] = chans[0]
        _ports[id(stubs[0])] = port
        yield stubs, fake, prom, shard_server
    finally:
        for c in chans:
            await c.close()
        terminate_popen(proc)
        await shard_server.stop(None)


# The first channel of each deployment, by its first stub (TGI's REST face over the same port),
# and the router's port (for connections a test opens itself).
_channels: dict[int, grpc.aio.Channel] = {}
_ports: dict[int, int] = {}


@pytest.fixture
async def deployment(tokenizer_dir: Path) -> AsyncIterator[tuple[object, FakeShard, int, object]]:
    # 5 ms a step: the "doomed" stream below must still be running when its shard stops, even
    # when a loaded machine starves this event loop for a while after its first token.
    async with _deploy(tokenizer_dir, max_concurrent=64, step_delay_s=0.005) as (
        stubs,
        fake,
        prom,
        shard,
    ):
        yield stubs[0], fake, prom, shard


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
    stub, fake, prom, shard_server = deployment
    # The metrics ports may still be coming up when the gRPC port answers SERVING (one full run
    # was refused here): wait for them rather than assume.
    before = scrape_when_up(prom)
    for i in (1, 2):
        scrape_when_up(prom + i)
    total = before["tokenwire_kv_blocks_total"]
    cancelled_before = sum(_cancelled_count(prom + i) for i in (1, 2))
    # The cancelled half asks for 200 tokens (1 s of 5 ms steps), the survivors for 30: only a
    # working cancel keeps the shard from generating the cancelled half to the end.
    calls = [
        stub.GenerateStream(_req(f"stream {i} " * 3, 200 if i % 2 == 0 else 30)) for i in range(16)
    ]
    firsts = [await c.read() for c in calls]
    assert all(f.index == 0 for f in firsts)
    generated_before = fake.generated_tokens - 16  # the first tokens above
    for c in calls[::2]:
        c.cancel()
    for c in calls[1::2]:
        n = 1
        while (await c.read()) is not grpc.aio.EOF:
            n += 1
        assert n == 30
    await until(
        lambda: not fake.reqs and scrape(prom)["tokenwire_kv_blocks_free"] == total,
        timeout=30.0,
        what="the shard holds no request and every KV block is free",
    )
    # The shard stopped generating for the cancelled 8 soon after the cancel (no-op cancel:
    # 8 x 200 tokens); the survivors generated 8 x 30.
    cancelled_tokens = fake.generated_tokens - generated_before - 8 * 30
    assert cancelled_tokens < 8 * 100, cancelled_tokens
    after = scrape(prom)
    assert (
        after["tokenwire_requests_aborted_total"] - before["tokenwire_requests_aborted_total"] == 8
    )
    assert sum(_cancelled_count(prom + i) for i in (1, 2)) - cancelled_before == 8

    long = stub.GenerateStream(_req("doomed stream", 240))  # >= 1.2 s of steps
    await long.read()
    await shard_server.stop(None)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while (await long.read()) is not grpc.aio.EOF:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_max_concurrent_requests_is_global(tokenizer_dir: Path) -> None:
    """--max-concurrent-requests counts the requests of every front end: with `limit` streams
    held in flight through front end A, every call through front end B is refused
    (RESOURCE_EXHAUSTED naming the flag), and so is one more through A's own connection.

    Nothing here depends on timing or on the kernel's spread of connections: each connection's
    front end is identified (the front-end metrics port whose request count its probe call
    raises), the held streams are seen streaming before the excess calls are made, and a held
    stream lasts >= 7.5 s (150 steps of 50 ms) while the refusals take milliseconds."""
    limit = 8
    async with _deploy(
        tokenizer_dir, max_concurrent=limit, channels=16, step_delay_s=0.05
    ) as (stubs, _, prom, _):
        ports = [prom + i for i in (1, 2)]
        by_front_end: list[list[object]] = [[], []]
        probes = 0
        for stub in stubs:
            by_front_end[await _front_end_of(stub, ports)].append(stub)
            probes += 1
        # Connections made while only one front end listened all stay on it: open new ones
        # until both front ends hold one (64 at most).
        opts = [("grpc.use_local_subchannel_pool", 1)]
        extra = []
        while not all(by_front_end) and len(extra) < 64:
            extra.append(grpc.aio.insecure_channel(f"127.0.0.1:{_ports[id(stubs[0])]}", options=opts))
            stub = generate_pb2_grpc.TextGenerationStub(extra[-1])
            by_front_end[await _front_end_of(stub, ports)].append(stub)
            probes += 1
        assert all(by_front_end), [len(s) for s in by_front_end]
        on_a, on_b = by_front_end
        held = [on_a[i % len(on_a)].GenerateStream(_req(f"busy {i}", 150)) for i in range(limit)]  # type: ignore[attr-defined]
        for stream in held:
            await stream.read()  # its first token: admitted and in flight
        excess = [on_b[i % len(on_b)] for i in range(limit)] + [on_a[0]]
        for i, stub in enumerate(excess):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(_req(f"excess {i}", 1))  # type: ignore[attr-defined]
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
            assert "--max-concurrent-requests" in (err.value.details() or "")
        for stream in held:
            stream.cancel()
        for chan in extra:
            await chan.close()
        # Each front end serves its request metrics on PORT+i; together they saw every call:
        # the probes, `limit` held streams and limit + 1 refusals.
        calls = probes + 2 * limit + 1
        counts = [scrape(port).total("tokenwire_request_count_total") for port in ports]
        assert sum(counts) == calls, counts
        # TGI's GET /metrics (what Envoy's route calls), answered by whichever front end holds
        # the connection: the merged text of PORT, every front end's requests and the engine's.
        reply = await tgi_pb2_grpc.TgiHttpServiceStub(_channels[id(stubs[0])]).Metrics(
            HttpBody()
        ).read()
        families = {
            f.name: f for f in text_string_to_metric_families(reply.data.decode())
        }
        assert "tokenwire_kv_blocks_total" in families
        total = sum(s.value for s in families["tokenwire_request_count"].samples
                    if s.name == "tokenwire_request_count_total")  # fmt: skip
        assert total == calls, total


async def _front_end_of(stub: object, ports: list[int]) -> int:
    """Which front end serves `stub`'s connection: the one whose admitted-request count a
    one-token call raises (counted at admission, before the reply is sent)."""
    before = [scrape_when_up(port).total("tokenwire_request_count_total") for port in ports]
    await stub.Generate(_req("probe", 1))  # type: ignore[attr-defined]
    after = [scrape(port).total("tokenwire_request_count_total") for port in ports]
    raised = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]
    assert len(raised) == 1, (before, after)
    return raised[0]


def _cancelled_count(frontend_port: int) -> float:
    """Client cancellations one front end counted (tokenwire_request_failure{reason=cancelled})."""
    return scrape(frontend_port).total("tokenwire_request_failure_total", reason="cancelled")


async def test_stop_sequences_end_streams_in_the_front_ends(wide_tokenizer_dir: Path) -> None:
    """Issue 23 item 3: the front ends detokenize and match stop sequences (the fake shard knows
    none); a match ends the stream with the text up to the stop, stops the request in the
    scheduler process and gives its KV blocks back."""
    async with _deploy(wide_tokenizer_dir, max_concurrent=64) as (stubs, fake, prom, _):
        stub = stubs[0]
        total = scrape(prom)["tokenwire_kv_blocks_total"]
        aborted = scrape(prom)["tokenwire_requests_aborted_total"]
        full = await stub.Generate(_req("w1 w2 w3", 60, details=True, seed=7))
        texts = [t.text for t in full.details.tokens]
        assert all(texts) and full.generated_text == "".join(texts)
        stop = texts[9][-2:] + texts[10][:3]  # spans two tokens
        end = full.generated_text.find(stop) + len(stop)
        k = next(k for k in range(60) if len("".join(texts[: k + 1])) >= end)
        want = "".join(texts[: k + 1])
        generated_before = fake.generated_tokens
        req = _req("w1 w2 w3", 60, details=True, seed=7, stop=[stop, "never"])
        events = [e async for e in stub.GenerateStream(req)]
        unary = await stub.Generate(req)
        assert [e.token.text for e in events] == texts[: k + 1]
        assert events[-1].generated_text == unary.generated_text == want
        for details in (events[-1].details, unary.details):
            assert details.finish_reason == "stop_sequence" and details.generated_tokens == k + 1
        await until(
            lambda: not fake.reqs and scrape(prom)["tokenwire_kv_blocks_free"] == total,
            timeout=30.0,
            what="the stopped requests left the shard and every KV block is free",
        )
        # Stopped, not run on to max_new_tokens (a step or two of overshoot at most), and not
        # counted as aborted.
        assert fake.generated_tokens - generated_before < 2 * (k + 1 + 8)
        assert scrape(prom)["tokenwire_requests_aborted_total"] == aborted
