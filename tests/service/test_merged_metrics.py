"""MergedMetrics (what the scheduler process of `--frontends N` serves on PORT): two real
metrics endpoints over HTTP, summed by name and labels; creation times and *_info values take
the maximum; the families the scheduler makes itself are left out; a dead endpoint is skipped."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.observability.merged_metrics import MergedMetrics
from service.observability.metrics import MetricsServer
from tests.helpers.ports import free_port


def _front_end(requests: dict[str, int], latency: list[float], info: float) -> CollectorRegistry:
    r = CollectorRegistry()
    count = Counter("tokenwire_request_count", "requests", ["method"], registry=r)
    for method, n in requests.items():
        count.labels(method).inc(n)
    hist = Histogram("tokenwire_latency_seconds", "latency", buckets=(0.1, 1.0), registry=r)
    for value in latency:
        hist.observe(value)
    Gauge("tokenwire_lora_requests_info", "GIE", ["running"], registry=r).labels("a").set(info)
    Gauge("tokenwire_kv_blocks_total", "a copy of the engine's", registry=r).set(100)
    return r


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_sums_front_ends_and_skips_own_families() -> None:
    one = _front_end({"generate": 3, "chat": 1}, [0.05, 0.5], info=10.0)
    two = _front_end({"generate": 4}, [2.0], info=20.0)
    servers = [MetricsServer(r, free_port(), "127.0.0.1") for r in (one, two)]
    try:
        urls = [f"http://127.0.0.1:{s.port}/metrics" for s in servers]
        urls.append(f"http://127.0.0.1:{free_port()}/metrics")  # a front end that is gone
        merged = CollectorRegistry()
        merged.register(MergedMetrics(urls, lambda: {"tokenwire_kv_blocks_total"}))
        got = _samples(merged)
    finally:
        for s in servers:
            s.close()
    assert got[("tokenwire_request_count_total", (("method", "generate"),))] == 7
    assert got[("tokenwire_request_count_total", (("method", "chat"),))] == 1
    assert got[("tokenwire_latency_seconds_bucket", (("le", "0.1"),))] == 1
    assert got[("tokenwire_latency_seconds_bucket", (("le", "1.0"),))] == 2
    assert got[("tokenwire_latency_seconds_bucket", (("le", "+Inf"),))] == 3
    assert got[("tokenwire_latency_seconds_count", ())] == 3
    assert abs(got[("tokenwire_latency_seconds_sum", ())] - 2.55) < 1e-9
    assert got[("tokenwire_lora_requests_info", (("running", "a"),))] == 20.0  # max, not sum
    created = got[("tokenwire_request_count_created", (("method", "generate"),))]
    assert created == max(
        _samples(r)[("tokenwire_request_count_created", (("method", "generate"),))]
        for r in (one, two)
    )
    assert not any(name == "tokenwire_kv_blocks_total" for name, _ in got)
