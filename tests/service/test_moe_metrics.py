"""tokenwire_moe_expert_load_ratio: the engine folds the shards' routing windows (StepOutput.
expert_load) into a histogram of each expert's load relative to its fair share, which the
router's /metrics exposes."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from service.engine.contracts import (
    EXPERT_LOAD_BOUNDS,
    EngineStats,
    ExpertLoadHistogram,
    SamplingConfig,
    StoppingConfig,
    ValidatedRequest,
)
from service.observability.metrics import ServerMetrics
from service.testing import FakeShardConfig
from tests.helpers.engine_harness import engine_on_fake_shard


def test_each_window_observes_every_experts_share_times_the_expert_count():
    h = ExpertLoadHistogram()
    h.observe((0, 0, 0, 0))  # nothing routed: no window
    assert h.windows == 0
    h.observe((10, 10, 20, 0))  # ratios 1.0, 1.0, 2.0, 0.0
    h.observe((5, 5, 5, 5))  # balanced: 1.0 each
    assert h.windows == 2 and h.total == 8.0
    at = {b: i for i, b in enumerate(EXPERT_LOAD_BOUNDS)}
    assert h.counts[at[0.0]] == 1 and h.counts[at[1.1]] == 6 and h.counts[at[2.0]] == 1
    assert sum(h.counts) == 8


@pytest.mark.timeout(30)
async def test_the_engine_folds_every_reported_window_into_its_stats():
    """A shard answering every step with a window of (6, 2, 0, 0) routed pairs: each step's
    window is one observation per expert (ratios 3, 1, 0, 0)."""
    async for h in engine_on_fake_shard(FakeShardConfig(num_blocks=64, block_size=4,
                                                        expert_load=(6, 2, 0, 0))):
        assert h.engine.stats().expert_load is None  # nothing reported yet
        request = ValidatedRequest(request_id="t", input_ids=(5, 6, 7), sampling=SamplingConfig(),
                                   stopping=StoppingConfig(max_new_tokens=4))
        events = [ev async for ev in h.engine.submit(request)]
        await asyncio.sleep(0)
        load = h.engine.stats().expert_load
        assert len(events) == 4 and load is not None and load.windows >= 4
        assert sum(load.counts) == 4 * load.windows and load.total == 4.0 * load.windows
        at = {b: i for i, b in enumerate(EXPERT_LOAD_BOUNDS)}
        assert load.counts[at[0.0]] == 2 * load.windows
        assert load.counts[at[1.1]] == load.counts[at[3.0]] == load.windows


def test_metrics_endpoint_exposes_the_histogram_only_for_moe_models():
    h = ExpertLoadHistogram()
    h.observe((30, 10, 0, 0))  # ratios 3.0, 1.0, 0, 0
    text = generate_latest(ServerMetrics(lambda: EngineStats(expert_load=h)).registry).decode()
    assert 'tokenwire_moe_expert_load_ratio_bucket{le="0.0"} 2.0' in text
    assert 'tokenwire_moe_expert_load_ratio_bucket{le="1.1"} 3.0' in text
    assert 'tokenwire_moe_expert_load_ratio_bucket{le="2.0"} 3.0' in text
    assert 'tokenwire_moe_expert_load_ratio_bucket{le="3.0"} 4.0' in text
    assert 'tokenwire_moe_expert_load_ratio_bucket{le="+Inf"} 4.0' in text
    assert "tokenwire_moe_expert_load_ratio_count 4.0" in text
    assert "tokenwire_moe_expert_load_ratio_sum 4.0" in text
    dense = generate_latest(ServerMetrics(lambda: EngineStats()).registry).decode()
    assert "moe_expert_load" not in dense
