"""The replicas the picker chooses from and what their Prometheus metrics say about their load.

Each backend is scraped every `interval` seconds (GIE's model-server protocol: waiting and
running requests, KV-cache usage as a fraction, block size and count). The metric names are
parameters, tokenwire's by default, so the picker also reads other model servers. A replica is
ready while its last scrapes answered and the last says it is serving; its recent picks (decayed
over about one scrape interval) are added to its load, so a burst between two scrapes still
spreads.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

_log = logging.getLogger("tokenwire.picker")


@dataclass(frozen=True)
class MetricNames:
    """Where each signal is read (GIE's flags of the same meaning in brackets)."""

    waiting: str = "tokenwire_queue_size"  # [--total-queued-requests-metric]
    running: str = "tokenwire_running_requests"  # [--total-running-requests-metric]
    kv_usage: str = "tokenwire_kv_cache_usage_ratio"  # [--kv-cache-usage-percentage-metric]
    cache_info: str = "tokenwire_cache_config_info"  # [--cache-info-metric]
    serving: str = "tokenwire_serving"  # tokenwire only; absent: serving while it answers


@dataclass(frozen=True)
class ReplicaLoad:
    """One scrape's reading."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    serving: bool = True
    block_size: int | None = None
    num_blocks: int | None = None


def parse_load(text: str, names: MetricNames) -> ReplicaLoad:
    """Reads the signals out of a Prometheus text exposition (missing ones stay at defaults)."""
    values: dict[str, float] = {}
    block_size = num_blocks = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == names.cache_info:
                labels = sample.labels
                if labels.get("block_size", "").isdigit():
                    block_size = int(labels["block_size"])
                if labels.get("num_gpu_blocks", "").isdigit():
                    num_blocks = int(labels["num_gpu_blocks"])
            elif sample.name in (names.waiting, names.running, names.kv_usage, names.serving):
                values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return ReplicaLoad(
        waiting=values.get(names.waiting, 0.0),
        running=values.get(names.running, 0.0),
        kv_usage=values.get(names.kv_usage, 0.0),
        serving=values.get(names.serving, 1.0) > 0.0,
        block_size=block_size,
        num_blocks=num_blocks,
    )


@dataclass(frozen=True)
class Backend:
    """A replica as configured: its gRPC address (what Envoy routes to) and metrics URL."""

    host: str
    port: int
    metrics_url: str

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_backends(
    spec: str, metrics_port: int | None, metrics_path: str = "/metrics"
) -> list[Backend]:
    """`HOST:PORT[/METRICS_PORT],...` -> backends. Without a per-backend metrics port,
    `metrics_port` applies (every replica on its own host exposing the same port)."""
    backends: list[Backend] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        address, _, mport = item.partition("/")
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"--backends: {item!r} is not HOST:PORT[/METRICS_PORT]")
        if mport and not mport.isdigit():
            raise ValueError(f"--backends: metrics port of {item!r} is not a number")
        chosen = int(mport) if mport else metrics_port
        if chosen is None:
            raise ValueError(
                f"--backends: {item!r} names no metrics port (HOST:PORT/METRICS_PORT) and "
                "--metrics-port is not set"
            )
        host = host.strip("[]")
        url_host = f"[{host}]" if ":" in host else host
        backends.append(Backend(host, int(port), f"http://{url_host}:{chosen}{metrics_path}"))
    if not backends:
        raise ValueError("--backends names no replica")
    return backends


def fetch_text(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode("utf-8", "replace")


def resolve(host: str, port: int) -> str:
    """`ip:port` of a backend as Envoy's STRICT_DNS cluster names it (first address)."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return f"{host}:{port}"
    ip = info[0][4][0]
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


@dataclass
class Replica:
    """Live state of one backend."""

    backend: Backend
    endpoint: str  # ip:port as Envoy's endpoint address
    load: ReplicaLoad | None = None
    failures: int = 0  # consecutive failed scrapes
    picks: int = 0
    recent_picks: float = 0.0  # picks, decayed with time constant `pick_decay_s`
    recent_at: float = 0.0  # time.monotonic() of the last update of recent_picks
    pick_decay_s: float = 0.25
    share_picks: float = 0.0  # picks, decayed with time constant `share_decay_s`
    share_decay_s: float = 10.0
    # A busy replica's metrics endpoint may miss a scrape: it stays ready (on its last reading)
    # until this many fail in a row. Envoy's health checks eject dead replicas independently.
    max_failures: int = 3

    @property
    def reachable(self) -> bool:
        return self.load is not None and self.failures < self.max_failures

    @property
    def ready(self) -> bool:
        return self.reachable and self.load is not None and self.load.serving

    def _decayed(self, now: float) -> float:
        return self.recent_picks * math.exp(-(now - self.recent_at) / self.pick_decay_s)

    def share(self, now: float | None = None) -> float:
        """Recent picks over about `share_decay_s` seconds (the replica's recent share)."""
        now = time.monotonic() if now is None else now
        return self.share_picks * math.exp(-(now - self.recent_at) / self.share_decay_s)

    def picked(self) -> None:
        now = time.monotonic()
        self.picks += 1
        self.share_picks = self.share(now) + 1.0
        self.recent_picks, self.recent_at = self._decayed(now) + 1.0, now

    def estimated_load(self) -> float:
        """Waiting + running requests at the last scrape, plus the picks of the last moments
        (requests sent there that its metrics may not show yet)."""
        base = self.load.waiting + self.load.running if self.load is not None else 0.0
        return base + self._decayed(time.monotonic())


Fetch = Callable[[str], Awaitable[str]]


class ReplicaSet:
    """Scrapes every backend's metrics; `on_reset(endpoint)` is called when a replica comes back
    after being unreachable or not serving (its cache is not what it was)."""

    def __init__(
        self,
        backends: list[Backend],
        names: MetricNames,
        *,
        fetch: Fetch | None = None,
        timeout: float = 2.0,
        on_reset: Callable[[str], None] | None = None,
    ) -> None:
        self.names = names
        self.timeout = timeout
        self._fetch = fetch or self._fetch_url
        self._on_reset = on_reset
        self.replicas = [Replica(b, resolve(b.host, b.port)) for b in backends]
        self.scraped = asyncio.Event()  # set after the first full round

    async def _fetch_url(self, url: str) -> str:
        return await asyncio.to_thread(fetch_text, url, self.timeout)

    async def _scrape(self, replica: Replica) -> None:
        was_ready = replica.ready
        try:
            text = await asyncio.wait_for(
                self._fetch(replica.backend.metrics_url), self.timeout + 0.5
            )
            load = parse_load(text, self.names)
        except Exception as error:  # noqa: BLE001 - any failure counts; see Replica.max_failures
            replica.failures += 1
            if replica.failures == replica.max_failures:
                _log.warning("replica %s: metrics unreachable (%s)", replica.endpoint, error)
            return
        replica.endpoint = await asyncio.to_thread(
            resolve, replica.backend.host, replica.backend.port
        )
        replica.load, replica.failures = load, 0
        if not was_ready and replica.ready and self._on_reset is not None:
            self._on_reset(replica.endpoint)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._scrape(r) for r in self.replicas))
        self.scraped.set()

    async def poll_forever(self, interval: float) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(interval)
