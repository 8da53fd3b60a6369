"""Engine against the fake shard over real grpc.aio loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from functools import partial

import pytest

from service.engine.backend import WarmupBudgets
from service.engine.contracts import (
    DeadlineExceededError,
    DrainingError,
    FinishReason,
    OverloadedError,
    SamplingConfig,
    ShardUnavailableError,
    StoppingConfig,
    ValidatedRequest,
)
from service.engine.engine import EngineConfig, LocalEngine
from service.shard_client.client import connect_and_warmup
from service.testing import FakeShardConfig, expected_tokens, start_fake_shard
from tests.helpers.engine_harness import Harness, engine_on_fake_shard
from tests.helpers.waiting import until


def _all_free(engine: LocalEngine) -> bool:
    """Nothing queued or running and every KV block free: the engine is idle."""
    st = engine.stats()
    return st.queued == 0 and st.running == 0 and st.kv_blocks_free == st.kv_blocks_total


pytestmark = pytest.mark.timeout(30)


def req(prompt: list[int], n: int, **kw) -> ValidatedRequest:
    return ValidatedRequest(
        request_id="t",
        input_ids=tuple(prompt),
        sampling=SamplingConfig(),
        stopping=StoppingConfig(max_new_tokens=n),
        **kw,
    )


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    async for x in engine_on_fake_shard():
        yield x


async def collect(stream) -> list:
    return [ev async for ev in stream]


async def test_single_request_streams_tokens_then_finishes(h: Harness) -> None:
    prompt = [5, 6, 7, 8, 9]
    events = await asyncio.wait_for(collect(h.engine.submit(req(prompt, 6))), 5)
    assert [e.token.id for e in events] == expected_tokens(prompt, 6)
    assert all(e.finished is None for e in events[:-1])
    fin = events[-1].finished
    assert fin.finish_reason is FinishReason.LENGTH and fin.generated_tokens == 6
    assert fin.generated_text == "".join(e.token.text for e in events)
    st = h.engine.stats()
    assert st.kv_blocks_free == st.kv_blocks_total and st.running == 0 and st.queued == 0


async def test_concurrent_requests_all_correct_with_chunking(h: Harness) -> None:
    prompts = [[i] * (3 + 7 * (i % 9)) for i in range(48)]
    streams = [h.engine.submit(req(p, 5 + i % 11)) for i, p in enumerate(prompts)]
    results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 10)
    for i, (p, evs) in enumerate(zip(prompts, results, strict=True)):
        assert [e.token.id for e in evs] == expected_tokens(p, 5 + i % 11)
    st = h.engine.stats()
    assert st.kv_blocks_free == st.kv_blocks_total
    assert h.shard.reqs == {}  # the shard forgot everything too


async def test_preemption_under_tiny_kv_cache_keeps_outputs() -> None:
    async for h in engine_on_fake_shard(FakeShardConfig(num_blocks=24, block_size=4)):
        prompts = [[100 + i] * 20 for i in range(8)]
        streams = [h.engine.submit(req(p, 30)) for p in prompts]
        results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 10)
        for p, evs in zip(prompts, results, strict=True):
            assert [e.token.id for e in evs] == expected_tokens(p, 30)
        st = h.engine.stats()
        assert st.preemptions > 0
        assert st.kv_blocks_free == st.kv_blocks_total
        h.engine.blocks.check_invariants()


async def test_prefix_cache_hit_verified_by_shard(h: Harness) -> None:
    prefix = list(range(1, 33))
    first = await collect(h.engine.submit(req(prefix + [99], 3)))
    computed = h.engine.stats().prefill_tokens_computed
    second = await collect(h.engine.submit(req(prefix + [77], 3)))
    st = h.engine.stats()
    assert st.prefill_tokens_computed - computed == 1  # 32 tokens came from the cache
    assert second[-1].finished.prefix_cache_hit_tokens == 32
    assert [e.token.id for e in second] == expected_tokens(prefix + [77], 3)
    assert first[-1].finished.prefix_cache_hit_tokens == 0


async def test_prefill_logprobs_and_top_tokens(h: Harness) -> None:
    evs = await collect(h.engine.submit(req([1, 2, 3], 2, prefill_logprobs=True, top_n_tokens=2)))
    assert [t.id for t in evs[0].prefill] == [1, 2, 3]
    assert evs[1].prefill is None
    assert len(evs[0].top_tokens) == 2


async def test_cancel_frees_blocks_and_others_complete() -> None:
    async for h in engine_on_fake_shard(
        FakeShardConfig(num_blocks=256, block_size=4, step_delay_s=0.005)
    ):
        prompts = [[i + 1] * 10 for i in range(16)]
        # The cancelled half (even i) asks for 400 tokens: a no-op cancel would generate them all.
        streams = [
            h.engine.submit(req(p, 400 if i % 2 == 0 else 40)) for i, p in enumerate(prompts)
        ]

        async def consume(i, s):
            out = []
            async for ev in s:
                out.append(ev)
                if i % 2 == 0 and len(out) == 3:
                    s.cancel()
                    break
            return out

        results = await asyncio.wait_for(
            asyncio.gather(*(consume(i, s) for i, s in enumerate(streams))), 10
        )
        for i, evs in enumerate(results):
            if i % 2:
                assert [e.token.id for e in evs] == expected_tokens(prompts[i], 40)
        await until(partial(_all_free, h.engine), timeout=5, what="nothing running, blocks free")
        st = h.engine.stats()
        assert st.aborted == 8
        assert h.shard.filter_calls > 0 and h.shard.reqs == {}
        # Each cancelled request stopped within a step or two of its cancel (after 3 tokens).
        assert h.shard.generated_tokens - 8 * 40 <= 8 * 5, h.shard.generated_tokens


async def test_deadline_exceeded() -> None:
    async for h in engine_on_fake_shard(
        FakeShardConfig(num_blocks=64, block_size=4, step_delay_s=0.01)
    ):
        s = h.engine.submit(req([1, 2], 200, deadline=time.monotonic() + 0.1))
        with pytest.raises(DeadlineExceededError):
            await asyncio.wait_for(collect(s), 5)
        ok = await asyncio.wait_for(collect(h.engine.submit(req([3], 2))), 5)
        assert len(ok) == 2
        await until(partial(_all_free, h.engine), timeout=5, what="nothing running, blocks free")
        assert h.engine.stats().aborted == 1  # the deadline removed it


async def test_overload_rejected_at_once() -> None:
    async for h in engine_on_fake_shard(
        FakeShardConfig(num_blocks=64, block_size=4, step_delay_s=0.01), max_concurrent_requests=4
    ):
        streams = [h.engine.submit(req([1], 5)) for _ in range(4)]
        with pytest.raises(OverloadedError):
            h.engine.submit(req([1], 5))
        await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 5)
        await collect(h.engine.submit(req([1], 2)))  # capacity is back


async def test_request_larger_than_kv_cache_rejected(h: Harness) -> None:
    with pytest.raises(OverloadedError, match="KV cache"):
        h.engine.submit(req([1] * 1000, 100))


async def test_shard_failure_fails_everything_and_marks_unhealthy() -> None:
    async for h in engine_on_fake_shard(
        FakeShardConfig(num_blocks=64, block_size=4, fail_after_steps=3)
    ):
        streams = [h.engine.submit(req([i + 1], 50)) for i in range(4)]
        for s in streams:
            with pytest.raises(ShardUnavailableError):
                await asyncio.wait_for(collect(s), 5)
        assert not h.engine.healthy and h.unhealthy and "UNAVAILABLE" in h.unhealthy[0]
        with pytest.raises(ShardUnavailableError):
            h.engine.submit(req([1], 2))


async def test_shard_gone_is_unavailable_not_a_hang() -> None:
    server, _, url = await start_fake_shard(
        FakeShardConfig(num_blocks=64, block_size=4, step_delay_s=0.01)
    )
    client, _, _ = await connect_and_warmup(url, WarmupBudgets(64, 128, 64, 8), step_timeout_s=2)
    engine = LocalEngine(EngineConfig(num_blocks=64, block_size=4), client)
    await engine.start()
    s = engine.submit(req([1], 200))
    await s.__anext__()
    await server.stop(0)
    with pytest.raises(ShardUnavailableError):
        await asyncio.wait_for(collect(s), 5)
    assert not engine.healthy
    await engine.stop()
    await client.close()


async def test_drain_stops_admission_and_waits() -> None:
    async for h in engine_on_fake_shard(
        FakeShardConfig(num_blocks=64, block_size=4, step_delay_s=0.005)
    ):
        s = h.engine.submit(req([1], 10))
        task = asyncio.ensure_future(collect(s))
        assert await h.engine.drain(5)
        assert len(await task) == 10
        with pytest.raises(DrainingError):
            h.engine.submit(req([1], 2))


async def test_drain_timeout_fails_leftovers() -> None:
    async for h in engine_on_fake_shard(
        FakeShardConfig(num_blocks=64, block_size=4, step_delay_s=0.01)
    ):
        s = h.engine.submit(req([1], 200))
        assert not await h.engine.drain(0.05)
        with pytest.raises(DrainingError):
            await asyncio.wait_for(collect(s), 5)


async def test_every_rpc_goes_to_every_rank() -> None:
    from service.shard_client.client import ShardClient

    cfg = FakeShardConfig(num_blocks=64, block_size=4)
    servers = [await start_fake_shard(FakeShardConfig(**vars(cfg))) for _ in range(2)]
    client = ShardClient([url for _, _, url in servers], step_timeout_s=5)
    engine = LocalEngine(EngineConfig(num_blocks=64, block_size=4), client)
    await engine.start()
    try:
        streams = [engine.submit(req([i + 1] * 5, 8)) for i in range(4)]
        results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 5)
        assert all(len(r) == 8 for r in results)
        steps = [shard.steps for _, shard, _ in servers]
        assert steps[0] == steps[1] > 0
        assert all(shard.reqs == {} for _, shard, _ in servers)
    finally:
        await engine.stop()
        await client.close()
        for server, _, _ in servers:
            await server.stop(0)


async def test_stress_prefix_sharing_preemption_and_cancels_keep_kv_consistent() -> None:
    import random

    rng = random.Random(1)
    # The fake shard checks every cached slot's token, block ownership and batch membership.
    async for h in engine_on_fake_shard(
        FakeShardConfig(num_blocks=40, block_size=4), max_batch_prefill_tokens=24
    ):
        shared = [[7] * 12, [9] * 8]
        prompts = [rng.choice(shared) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))]
                   for _ in range(64)]  # fmt: skip
        lengths = [rng.randrange(1, 40) for _ in prompts]
        cancel_at = [rng.randrange(1, 10) if rng.random() < 0.25 else None for _ in prompts]
        streams = [h.engine.submit(req(p, n)) for p, n in zip(prompts, lengths, strict=True)]

        async def consume(i, s, cancel_at=cancel_at):
            out = []
            async for ev in s:
                out.append(ev.token.id)
                if cancel_at[i] is not None and len(out) == cancel_at[i]:
                    s.cancel()
                    return None
            return out

        results = await asyncio.wait_for(
            asyncio.gather(*(consume(i, s) for i, s in enumerate(streams))), 20
        )
        for p, n, out in zip(prompts, lengths, results, strict=True):
            if out is not None:
                assert out == expected_tokens(p, n)
        await until(partial(_all_free, h.engine), timeout=5, what="nothing running, blocks free")
        st = h.engine.stats()
        assert st.preemptions > 0 and st.prefix_cache_hit_tokens > 0
        assert st.kv_blocks_free == st.kv_blocks_total and st.running == 0 and st.queued == 0
        h.engine.blocks.check_invariants()
        assert h.shard.reqs == {} and h.engine.healthy
