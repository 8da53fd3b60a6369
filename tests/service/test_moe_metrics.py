"""tokenwire_moe_expert_load_ratio: the engine folds the shards' routing windows (StepOutput.
expert_load) into a histogram of each expert's load relative to its fair share, which the
router's /metrics exposes."""

from __future__ import annotations

from prometheus_client import generate_latest

from service.engine.contracts import EXPERT_LOAD_BOUNDS, EngineStats, ExpertLoadHistogram
from service.observability.metrics import ServerMetrics


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
