"""A real LocalEngine in front of the in-process fake shard (service/testing) over grpc.aio
loopback: for engine tests and for servicer tests that need the real engine's statistics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from service.engine.engine import EngineConfig, LocalEngine
from service.shard_client.client import connect_and_warmup
from service.engine.backend import WarmupBudgets
from service.testing import FakeShard, FakeShardConfig, start_fake_shard


@dataclass
class Harness:
    engine: LocalEngine
    shard: FakeShard  # the servicer object: its counters and live requests
    unhealthy: list[str]  # reasons passed to on_unhealthy


async def engine_on_fake_shard(
    shard_cfg: FakeShardConfig | None = None, **engine_kw: object
) -> AsyncIterator[Harness]:
    """Yields once (use `async for h in engine_on_fake_shard(...)`): the engine started and
    warmed up against a fresh fake shard; stops both after."""
    server, shard, url = await start_fake_shard(
        shard_cfg or FakeShardConfig(num_blocks=256, block_size=4)
    )
    client, warm, info = await connect_and_warmup(
        url, WarmupBudgets(1024, 2048, 256, 64), connect_timeout_s=5, step_timeout_s=5
    )
    assert info.model_type == "fake" and warm.num_blocks == shard.config.num_blocks
    cfg = {
        "num_blocks": warm.num_blocks,
        "block_size": warm.block_size,
        "max_concurrent_requests": 64,
        "max_batch_prefill_tokens": 64,
        "waiting_served_ratio": 0.0,
    }
    cfg.update(engine_kw)
    unhealthy: list[str] = []
    engine = LocalEngine(EngineConfig(**cfg), client, on_unhealthy=unhealthy.append)
    await engine.start()
    try:
        yield Harness(engine, shard, unhealthy)
    finally:
        await engine.stop()
        await client.close()
        await server.stop(0)
