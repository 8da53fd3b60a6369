"""Full garbage collections paced by the engine (shard.runtime.gc_pacing): none while steps
run, one when the engine goes idle, and one per max_interval_s on a server that never idles."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from service.engine.backend import WarmupBudgets
from service.engine.engine import EngineConfig, build_engine
from shard.runtime.gc_pacing import GcPacer
from service.shard_client.client import connect_and_warmup
from service.testing import FakeShardConfig, start_fake_shard
from tests.helpers.spec_engine import Req, validated


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle_in_generation_2() -> weakref.ref:
    """A garbage reference cycle that survived into the oldest generation."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    gc.collect(1)  # a and b survive (still referenced): moved to generation 2
    del a, b
    return ref


@pytest.fixture
def paced() -> Iterator[GcPacer]:
    """A GcPacer installed in this process; the process's GC settings restored afterwards."""
    thresholds = gc.get_threshold()
    pacer = GcPacer(max_interval_s=3600.0)
    pacer.install()
    try:
        yield pacer
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_no_full_collection_until_idle(paced: GcPacer) -> None:
    ref = _cycle_in_generation_2()
    for _ in range(200):  # young collections keep running; the old cycle stays
        [object() for _ in range(25_000)]
        gc.collect(1)
        paced.step()
    assert ref() is not None and paced.full_collections == 0
    paced.idle()
    assert ref() is None and paced.full_collections == 1
    paced.idle()  # nothing reached generation 2 since: no second collection
    assert paced.full_collections == 1


def test_a_busy_server_still_collects_every_interval(paced: GcPacer) -> None:
    paced.max_interval_s = 0.0
    ref = _cycle_in_generation_2()
    paced.step()
    assert ref() is None and paced.full_collections == 1


async def test_the_engine_collects_when_it_goes_idle(tokenizer_dir) -> None:
    """Through a LocalEngine over the fake shard: steps call step(), the idle engine idle()."""
    calls: list[str] = []

    class Recording(GcPacer):
        def idle(self) -> None:
            calls.append("idle")

        def step(self) -> None:
            calls.append("step")

    server, _, url = await start_fake_shard(FakeShardConfig(num_blocks=64, block_size=16))
    client, warm, _ = await connect_and_warmup(
        url, WarmupBudgets(64, 96, 256, 8), connect_timeout_s=5, step_timeout_s=5
    )
    engine = build_engine(client=client, warmup=warm, config=EngineConfig(overlap=True))
    engine.gc_pacer = Recording()  # not installed: this test process keeps its GC settings
    await engine.start()
    try:
        events = [ev async for ev in engine.submit(validated(Req([5, 6, 7], 12), 0))]
        assert events[-1].finished is not None
        for _ in range(100):
            if calls and calls[-1] == "idle":
                break
            await asyncio.sleep(0.01)
        first, last = calls.index("step"), len(calls) - 1 - calls[::-1].index("step")
        assert calls.count("step") >= 12 and calls[-1] == "idle"
        assert "idle" not in calls[first:last]  # never while the request runs
    finally:
        await engine.close()
        await server.stop(None)
