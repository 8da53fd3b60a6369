"""Speculative-decoding tests' deployment: a real shard (any model directory) served over real
gRPC from a thread of the test process, and router engines (LocalEngine: scheduler, proposer,
ShardClient) built against it one after the other with different --speculate settings, so one
loaded model serves the speculative run and its reference."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from service.engine.backend import WarmupBudgets
from service.engine.contracts import (
    SamplingConfig,
    StepEvent,
    StoppingConfig,
    ValidatedRequest,
)
from service.engine.engine import EngineConfig, LocalEngine, build_engine
from service.shard_client.client import connect_and_warmup
from shard.distributed.groups import Dist
from shard.server.loader import Shard, ShardConfig
from shard.server.main import start_server

# A small KV cache (24 blocks of 16 tokens) against up to 8 requests of up to ~110 tokens: the
# scheduler must preempt (tests of the step loop's corner cases).
PREEMPTING_BUDGETS = WarmupBudgets(
    max_input_tokens=64, max_total_tokens=160, max_batch_prefill_tokens=64, max_batch_size=8,
    max_batch_total_tokens=24 * 16,
)  # fmt: skip


class ShardServer:
    """A shard's grpc.aio server on its own event-loop thread (unix socket)."""

    def __init__(self, model_dir: Path, socket_dir: Path, **config: object) -> None:
        self.shard = Shard(ShardConfig(model_id=str(model_dir), **config), Dist())
        self.url = f"unix://{socket_dir}/shard-0"
        self.fatal: list[str] = []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        started = asyncio.run_coroutine_threadsafe(
            start_server(self.shard, [self.url], 0, self.fatal.append), self.loop
        )
        self.server, self.servicer, _ = started.result(60)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.servicer.close()
        self.loop.call_soon_threadsafe(self.loop.stop)


@asynccontextmanager
async def router_engine(
    url: str, budgets: WarmupBudgets, speculate: int, **engine_kw: object
) -> AsyncIterator[LocalEngine]:
    """A started LocalEngine warmed up against the shard at `url` (ClearCache + Warmup first)."""
    budgets = WarmupBudgets(
        budgets.max_input_tokens, budgets.max_total_tokens, budgets.max_batch_prefill_tokens,
        budgets.max_batch_size, budgets.max_batch_total_tokens,
        speculate_tokens=speculate, speculate_max_batch_size=16,
    )  # fmt: skip
    client, warm, _ = await connect_and_warmup(
        url, budgets, connect_timeout_s=30, step_timeout_s=300
    )
    kw: dict[str, object] = {
        "max_batch_prefill_tokens": budgets.max_batch_prefill_tokens,
        "max_batch_size": budgets.max_batch_size,
        "waiting_served_ratio": 0.0,
    }
    kw.update(engine_kw)
    cfg = EngineConfig(speculate=speculate, **kw)  # type: ignore[arg-type]
    engine = build_engine(client=client, warmup=warm, config=cfg)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()
        await client.close()


@dataclass(frozen=True)
class Req:
    """One test request: prompt ids and parameters."""

    prompt: list[int]
    max_new_tokens: int = 24
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    top_n: int = 0
    ignore_eos: bool = True


def validated(r: Req, i: int) -> ValidatedRequest:
    return ValidatedRequest(
        request_id=f"r{i}",
        input_ids=tuple(r.prompt),
        sampling=r.sampling,
        stopping=StoppingConfig(
            max_new_tokens=r.max_new_tokens, stop_sequences=r.stop, ignore_eos_token=r.ignore_eos
        ),
        top_n_tokens=r.top_n,
    )


async def run_all(
    engine: LocalEngine, reqs: list[Req], stagger_steps: int = 0
) -> list[list[StepEvent]]:
    """Submits every request (the i-th after i * stagger_steps engine steps, so requests join a
    decoding batch) and returns each one's events."""

    async def one(i: int, r: Req) -> list[StepEvent]:
        if stagger_steps:
            target = engine.stats().steps + i * stagger_steps
            while engine.stats().steps < target and engine.stats().running:
                await asyncio.sleep(0.001)
        return [ev async for ev in engine.submit(validated(r, i))]

    return list(await asyncio.wait_for(asyncio.gather(*(one(i, r) for i, r in enumerate(reqs))), 600))


def token_ids(events: list[StepEvent]) -> list[int]:
    return [e.token.id for e in events]
