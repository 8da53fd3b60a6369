"""Requests in flight per LoRA adapter, for the model-server protocol of Kubernetes' inference
gateway (GIE): its endpoint picker reads which adapters a replica is running and which wait
(`--lora-info-metric`), to send a request naming an adapter where that adapter is already
active. The metric follows vLLM's `vllm:lora_requests_info`:

    tokenwire_lora_requests_info{running_lora_adapters="a,b", waiting_lora_adapters="c",
                                 max_lora="4"} <unix time of the scrape>

one sample, its value the time (GIE keeps the newest). A request waits from admission to its
first token and runs from then until it ends. Base-model requests (no adapter) are not counted.
Exposed only while LoRA is on (`max_lora` > 0).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

METRIC = "tokenwire_lora_requests_info"


@dataclass
class AdapterSlot:
    """One request's place in AdapterLoad; `start()` at its first token, `leave()` at its end."""

    load: AdapterLoad | None
    adapter: str
    started: bool = False
    left: bool = False

    def start(self) -> None:
        if self.load is not None and not self.started and not self.left:
            self.started = True
            self.load.move(self.adapter)

    def leave(self) -> None:
        if self.load is not None and not self.left:
            self.left = True
            self.load.remove(self.adapter, self.started)


@dataclass
class AdapterLoad:
    """Waiting and running request counts by adapter name."""

    max_lora: int = 0  # the shards' adapter slots (0: LoRA off, nothing exposed)
    waiting: Counter[str] = field(default_factory=Counter)
    running: Counter[str] = field(default_factory=Counter)

    def enter(self, adapter: str) -> AdapterSlot:
        """A request naming `adapter` ("" = base model: not counted) was admitted."""
        if not adapter:
            return AdapterSlot(None, "")
        self.waiting[adapter] += 1
        return AdapterSlot(self, adapter)

    def move(self, adapter: str) -> None:
        self._decrement(self.waiting, adapter)
        self.running[adapter] += 1

    def remove(self, adapter: str, started: bool) -> None:
        self._decrement(self.running if started else self.waiting, adapter)

    @staticmethod
    def _decrement(counts: Counter[str], adapter: str) -> None:
        counts[adapter] -= 1
        if counts[adapter] <= 0:
            del counts[adapter]


class AdapterLoadCollector(Collector):
    """Turns AdapterLoad into `tokenwire_lora_requests_info` at scrape time."""

    def __init__(self, load: AdapterLoad) -> None:
        self._load = load

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        load = self._load
        if load.max_lora <= 0:
            return
        info = GaugeMetricFamily(
            METRIC,
            "LoRA adapters of the requests in flight: running (past their first token) and "
            "waiting, comma-separated, and the adapter slots (max_lora); the value is the time",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        info.add_metric(
            [",".join(sorted(load.running)), ",".join(sorted(load.waiting)), str(load.max_lora)],
            time.time(),
        )
        yield info
