"""Prometheus metrics of the router: per-request histograms observed by the generation service and
the engine's live counters, read from `Engine.stats()` at scrape time by a custom collector.

Everything hangs off one `CollectorRegistry` per server (no module-level registry), so two routers
in one process (tests) keep separate numbers.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from service.engine.contracts import EXPERT_LOAD_BOUNDS, EngineStats, ExpertLoadHistogram
from service.observability.adapter_load import AdapterLoad, AdapterLoadCollector

PREFIX = "tokenwire"
# Seconds: from sub-millisecond (validation, inter-token on a GPU) to minutes (long requests).
_DURATION_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class RequestRecord:
    """What one finished client request measured; fed to metrics and to the request log line."""

    method: str  # "generate" | "generate_stream"
    total_seconds: float
    validation_seconds: float
    queue_seconds: float
    inference_seconds: float
    input_tokens: int
    generated_tokens: int
    max_new_tokens: int


class EngineCollector(Collector):
    """Turns `EngineStats` into metric families when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        # Names are fixed except `extra`; an empty describe keeps registration from calling
        # collect() (and the engine) at construction.
        return []

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = (
            ("queue_size", "Requests admitted and waiting for their first step", s.queued),
            ("running_requests", "Requests holding KV blocks", s.running),
            ("batch_current_size", "Requests in the last engine step", s.last_batch_size),
            ("kv_blocks_total", "KV cache blocks", s.kv_blocks_total),
            ("kv_blocks_free", "KV cache blocks free or evictable", s.kv_blocks_free),
            (
                "kv_blocks_used",
                "KV cache blocks held by requests",
                s.kv_blocks_total - s.kv_blocks_free,
            ),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        # The model-server protocol of Kubernetes' inference gateway (GIE): KV-cache usage as a
        # fraction and the cache geometry as labels (vLLM's kv_cache_usage_perc and
        # cache_config_info); queue_size and running_requests above are its waiting/running.
        used = s.kv_blocks_total - s.kv_blocks_free
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_cache_usage_ratio",
            "Fraction of KV cache blocks held by requests (0 to 1)",
            value=used / s.kv_blocks_total if s.kv_blocks_total else 0.0,
        )
        info = GaugeMetricFamily(
            f"{PREFIX}_cache_config_info",
            "KV cache geometry in labels: block_size (tokens per block), num_gpu_blocks",
            labels=["block_size", "num_gpu_blocks"],
        )
        info.add_metric([str(s.block_size), str(s.kv_blocks_total)], 1.0)
        yield info
        counters = (
            ("engine_steps", "Engine steps run", s.steps),
            (
                "prefill_tokens_computed",
                "Prompt tokens computed by the shards",
                s.prefill_tokens_computed,
            ),
            (
                "prefix_cache_hit_tokens",
                "Prompt tokens served by the prefix cache",
                s.prefix_cache_hit_tokens,
            ),
            ("preemptions", "Requests preempted (freed and recomputed later)", s.preemptions),
            (
                "requests_aborted",
                "Requests removed before they finished (cancel, deadline, shard failure)",
                s.aborted,
            ),
            (
                "speculative_proposed_tokens",
                "Draft tokens sent to the shards for verification (speculative decoding)",
                s.spec_proposed_tokens,
            ),
            (
                "speculative_accepted_tokens",
                "Draft tokens the shards accepted (speculative decoding)",
                s.spec_accepted_tokens,
            ),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        if s.spec_step_tokens:
            yield _step_tokens_histogram(s.spec_step_tokens)
        if s.expert_load is not None:
            yield _expert_load_histogram(s.expert_load)
        for key, value in sorted(s.extra.items()):
            name = re.sub(r"[^a-zA-Z0-9_]", "_", key)
            yield GaugeMetricFamily(
                f"{PREFIX}_engine_{name}", f"Engine statistic {key}", value=value
            )


def _expert_load_histogram(h: ExpertLoadHistogram) -> HistogramMetricFamily:
    """One observation per expert and routing window of the shard (MoE models)."""
    buckets = []
    cumulative = 0
    for bound, count in zip(EXPERT_LOAD_BOUNDS, h.counts, strict=False):
        cumulative += count
        buckets.append((str(float(bound)), cumulative))
    buckets.append(("+Inf", cumulative + h.counts[-1]))
    return HistogramMetricFamily(
        f"{PREFIX}_moe_expert_load_ratio",
        "Mixture-of-experts load: per expert and window of shard steps, its share of the routed "
        "(token, layer) pairs times the number of experts (1 = its fair share, 0 = unused)",
        buckets=buckets,
        sum_value=h.total,
    )


def _step_tokens_histogram(counts: tuple[int, ...]) -> HistogramMetricFamily:
    """counts[n]: sequence-steps with drafts that gave their sequence n tokens, as a histogram
    with one bucket per n (1 .. 1 + --speculate)."""
    buckets = []
    cumulative = 0
    for n in range(1, len(counts)):
        cumulative += counts[n]
        buckets.append((str(float(n)), cumulative))
    buckets.append(("+Inf", cumulative))
    total = sum(n * c for n, c in enumerate(counts))
    return HistogramMetricFamily(
        f"{PREFIX}_speculative_accepted_tokens_per_step",
        "Tokens a sequence received from one step that verified its drafts (1 + drafts accepted)",
        buckets=buckets,
        sum_value=total,
    )


class ServerMetrics:
    """The router's metrics, registered in their own registry."""

    def __init__(
        self,
        stats: Callable[[], EngineStats] | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.request_count = Counter(
            f"{PREFIX}_request_count", "Client requests received", ["method"], registry=r
        )
        self.request_success = Counter(
            f"{PREFIX}_request_success", "Client requests that completed", ["method"], registry=r
        )
        self.request_failure = Counter(
            f"{PREFIX}_request_failure",
            "Client requests that failed, by reason (validation, overloaded, unavailable, deadline, "
            "generation, cancelled)",
            ["method", "reason"],
            registry=r,
        )
        self.in_flight = Gauge(
            f"{PREFIX}_requests_in_flight", "Client requests being served", registry=r
        )
        self.serving = Gauge(
            f"{PREFIX}_serving", "1 while health is SERVING, 0 otherwise", registry=r
        )

        def seconds(name: str, doc: str) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, buckets=_DURATION_BUCKETS, registry=r)

        def tokens(name: str, doc: str) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, buckets=_TOKEN_BUCKETS, registry=r)

        self.duration = seconds("request_duration_seconds", "Request duration, arrival to end")
        self.validation_duration = seconds(
            "request_validation_duration_seconds", "Validation and tokenization time"
        )
        self.queue_duration = seconds(
            "request_queue_duration_seconds", "Admission to the first scheduled step"
        )
        self.inference_duration = seconds(
            "request_inference_duration_seconds", "First scheduled step to finish"
        )
        self.time_to_first_token = seconds(
            "time_to_first_token_seconds", "Request arrival to its first generated token"
        )
        self.inter_token_latency = seconds(
            "inter_token_latency_seconds", "Time between consecutive tokens of one sequence"
        )
        self.input_tokens = tokens("request_input_length", "Prompt tokens per request")
        self.generated_tokens = tokens("request_generated_tokens", "Generated tokens per request")
        self.max_new_tokens = tokens("request_max_new_tokens", "max_new_tokens per request")
        # Per LoRA adapter ("" = the base model); an adapter's children go when it is unloaded.
        self.adapter_requests = Counter(
            f"{PREFIX}_adapter_requests", "Client requests by LoRA adapter (\"\": base model) "
            "and status (ok, or the failure reason)", ["adapter", "status"], registry=r,
        )  # fmt: skip
        self.adapter_input_tokens = Counter(
            f"{PREFIX}_adapter_input_tokens", "Prompt tokens of finished requests by LoRA adapter",
            ["adapter"], registry=r,
        )  # fmt: skip
        self.adapter_generated_tokens = Counter(
            f"{PREFIX}_adapter_generated_tokens",
            "Generated tokens of finished requests by LoRA adapter", ["adapter"], registry=r,
        )  # fmt: skip
        # OpenAI Responses' store (previous_response_id, GET /v1/responses/{id}).
        self.responses_store_evictions = Counter(
            f"{PREFIX}_responses_store_evictions",
            "Stored responses dropped before deletion, by reason (size: pushed out by a newer "
            "one at --responses-store-size; ttl: older than --responses-store-ttl)",
            ["reason"], registry=r,
        )  # fmt: skip
        self.responses_stored = Gauge(
            f"{PREFIX}_responses_stored", "Responses held in the Responses store", registry=r
        )
        if stats is not None:
            r.register(EngineCollector(stats))
        # GIE's lora_requests_info; serve() sets max_lora once the shards report their slots.
        self.adapter_load = AdapterLoad()
        r.register(AdapterLoadCollector(self.adapter_load))

    def observe_success(self, record: RequestRecord) -> None:
        self.request_success.labels(record.method).inc()
        self.duration.observe(record.total_seconds)
        self.validation_duration.observe(record.validation_seconds)
        self.queue_duration.observe(record.queue_seconds)
        self.inference_duration.observe(record.inference_seconds)
        self.input_tokens.observe(record.input_tokens)
        self.generated_tokens.observe(record.generated_tokens)
        self.max_new_tokens.observe(record.max_new_tokens)

    def observe_adapter(self, adapter: str, status: str, input_tokens: int = 0,
                        generated_tokens: int = 0) -> None:
        self.adapter_requests.labels(adapter, status).inc()
        if status == "ok":
            self.adapter_input_tokens.labels(adapter).inc(input_tokens)
            self.adapter_generated_tokens.labels(adapter).inc(generated_tokens)

    def forget_adapter(self, adapter: str) -> None:
        """Drops an unloaded adapter's label children (the label sets stay bounded by the
        adapters loaded at once)."""
        for counter in (self.adapter_input_tokens, self.adapter_generated_tokens):
            try:
                counter.remove(adapter)
            except KeyError:
                pass
        for labels in list(self.adapter_requests._metrics):
            if labels[0] == adapter:
                self.adapter_requests.remove(*labels)

    def observe_inter_token_latencies(self, gaps: list[float]) -> None:
        """Observes many inter-token gaps at once (one stream's, at its end)."""
        observe_many(self.inter_token_latency, gaps)

    def observe_response_eviction(self, reason: str) -> None:
        self.responses_store_evictions.labels(reason).inc()

    def observe_failure(self, method: str, reason: str) -> None:
        self.request_failure.labels(method, reason).inc()


def observe_many(histogram: Histogram, values: list[float]) -> None:
    """`histogram.observe(v)` for each value, with one bucket update per bucket touched and one
    sum update instead of one locked update per value and bucket (same resulting series)."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:  # another prometheus_client layout: the public API
            histogram.observe(v)
        return
    counts = [0] * len(bounds)
    for v in values:
        counts[bisect_left(bounds, v)] += 1  # first bucket with v <= bound, as observe()
    for i, n in enumerate(counts):
        if n:
            buckets[i].inc(n)
    total.inc(sum(values))


class MetricsServer:
    """The HTTP endpoint Prometheus scrapes (`/metrics`), on its own daemon thread."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> None:
        self._server: WSGIServer
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
