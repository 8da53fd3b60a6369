"""The request metrics of several processes as one: what the scheduler process of
`tokenwire router --frontends N` serves on --prometheus-port beside its engine metrics, so that
one scrape of PORT sees every request whatever front end served it (each front end also keeps
serving its own on PORT+i).

At scrape time it reads each front end's /metrics (Prometheus text, parsed by prometheus_client)
and adds up the samples of equal name and labels: counters, histogram buckets and sums, and
gauges of in-flight counts add across processes. Samples that are times rather than amounts
(`*_created`, and the `*_info` families whose value is a timestamp or 1) take the maximum
instead. Families the scheduler process produces itself (its engine collector, `serving`) are
left out: the front ends' copies of them would double them. A front end that does not answer
within the timeout is left out of that scrape.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

_FETCH_TIMEOUT_S = 1.0


def _keeps_max(family: str, sample: str) -> bool:
    return sample.endswith("_created") or family.endswith("_info")


class MergedMetrics(Collector):
    """Collector of the sum of the metrics served at `urls`, minus the families named by
    `own_names()` (read at each scrape)."""

    def __init__(self, urls: Iterable[str], own_names: Callable[[], set[str]]) -> None:
        self._urls = list(urls)
        self._own_names = own_names

    def describe(self) -> list[Metric]:
        return []  # names known only at scrape time; keeps registration from scraping

    def _texts(self) -> Iterator[str]:
        for url in self._urls:
            try:
                with urllib.request.urlopen(url, timeout=_FETCH_TIMEOUT_S) as reply:
                    yield reply.read().decode()
            except OSError:
                continue

    def collect(self) -> Iterator[Metric]:
        skip = self._own_names()
        merged: dict[str, Metric] = {}
        values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for text in self._texts():
            for family in text_string_to_metric_families(text):
                if family.name in skip:
                    continue
                if family.name not in merged:
                    merged[family.name] = Metric(family.name, family.documentation, family.type)
                    values[family.name] = {}
                sums = values[family.name]
                for sample in family.samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    if key not in sums:
                        sums[key] = sample.value
                    elif _keeps_max(family.name, sample.name):
                        sums[key] = max(sums[key], sample.value)
                    else:
                        sums[key] += sample.value
        for name, metric in merged.items():
            for (sample_name, labels), value in values[name].items():
                metric.add_sample(sample_name, dict(labels), value)
            yield metric
