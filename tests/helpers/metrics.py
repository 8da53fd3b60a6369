"""Reading a Prometheus /metrics endpoint in tests: one scraper for every test."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Scrape:
    """Every sample of one scrape, keyed by (sample name, sorted label pairs)."""

    samples: dict[tuple[str, Labels], float]

    def __getitem__(self, key: str | tuple[str, Labels]) -> float:
        """`scrape["name"]`: the unlabelled sample; `scrape[(name, labels)]`: a labelled one."""
        return self.samples[(key, ()) if isinstance(key, str) else key]

    def value(self, name: str, **labels: str) -> float:
        """The sample with exactly these labels (KeyError when it is absent)."""
        return self.samples[(name, tuple(sorted(labels.items())))]

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when none exist yet, as
        for a labelled counter that has not been incremented)."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= set(ls))


def scrape_when_up(port: int, timeout: float = 60.0, host: str = "127.0.0.1") -> Scrape:
    """scrape(), retried while the metrics server refuses or resets the connection (a front end
    whose metrics server is still starting, or slow to accept on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return scrape(port, host)
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def scrape(port: int, host: str = "127.0.0.1") -> Scrape:
    """Scrapes http://host:port/metrics."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return Scrape(
        {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
    )
