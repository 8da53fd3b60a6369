"""Where the router's engine comes from: connect to the shards (Info, Warmup), then build it.

`serve` (service.app.serve) takes an `EngineSource`; the default, `ShardEngineSource`, connects to
the shards and builds an in-process `LocalEngine`. The multi-process router's front ends plug
in theirs (`service.app.remote_engine.RemoteEngineSource`).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from service.app.router_flags import Limits, resolve_limits, shard_target, warmup_budgets
from service.engine.backend import ShardDescription, ShardRpcError, WarmupInfo
from service.engine.contracts import Engine
from service.engine.engine import EngineConfig, LocalEngine, build_engine
from service.shard_client.client import ShardClient, connect_and_warmup
from shard.runtime.gc_pacing import GcPacer


class ShardLink(Protocol):
    """What the router keeps of its connection to the shards: a health probe and close."""

    async def health(self) -> None:
        """Returns when every shard answers; raises ShardRpcError otherwise."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class ShardConnection:
    """What connecting to the shards yields: the link the router health-checks and closes, the
    Warmup answer, the shard's description and the resolved limits."""

    client: ShardLink
    warmup: WarmupInfo
    shard: ShardDescription
    limits: Limits


class EngineSource(Protocol):
    """Where `serve` gets its engine: connect (and warm up), then build the engine."""

    async def connect(self) -> ShardConnection:
        """Waits until the engine's backend is ready; raises when it cannot be reached."""
        ...

    def build_engine(
        self,
        connection: ShardConnection,
        config: EngineConfig,
        on_unhealthy: Callable[[str], None],
        on_adapter_removed: Callable[[str], None] | None = None,
    ) -> Engine:
        """The engine to serve with (`start()`, `drain()`, `close()` are called by serve);
        `on_unhealthy(reason)` is called when its backend fails, `on_adapter_removed(name)`
        when another process unloaded a LoRA adapter (this process's own unloads go through
        its GenerationService)."""
        ...


@dataclass(frozen=True)
class ShardEngineSource:
    """The default EngineSource: the shards themselves and an in-process LocalEngine.
    `pace_gc`: this process exists to run the engine (a router's entry point, not a test's
    process): its full garbage collections are paced by the engine (shard.runtime.gc_pacing),
    a process-wide setting."""

    args: argparse.Namespace
    pace_gc: bool = False

    async def connect(self) -> ShardConnection:
        return await connect_shards(self.args, shard_target(self.args))

    def build_engine(
        self,
        connection: ShardConnection,
        config: EngineConfig,
        on_unhealthy: Callable[[str], None],
        on_adapter_removed: Callable[[str], None] | None = None,
    ) -> LocalEngine:
        del on_adapter_removed  # the engine is this process's: unloads go through its service
        assert isinstance(connection.client, ShardClient)
        engine = build_engine(
            client=connection.client,
            warmup=connection.warmup,
            shard=connection.shard,
            config=config,
            on_unhealthy=on_unhealthy,
        )
        if self.pace_gc:
            engine.gc_pacer = GcPacer()
            engine.gc_pacer.install()
        return engine


async def connect_shards(args: argparse.Namespace, target: str) -> ShardConnection:
    """Connects to the shards and warms them up with the limits resolved against the model."""
    # Info first (max_position_embeddings decides the default limits), then warm up.
    probe = ShardClient([target])
    try:
        shard = await _retry_info(probe, args.startup_timeout)
    finally:
        await probe.close()
    limits = resolve_limits(args, shard.max_position_embeddings)
    client, warm, shard = await connect_and_warmup(
        target,
        warmup_budgets(args, limits),
        connect_timeout_s=args.startup_timeout,
        step_timeout_s=args.shard_step_timeout,
    )
    return ShardConnection(client, warm, shard, limits)


async def _retry_info(client: ShardClient, timeout_s: float) -> ShardDescription:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            return await client.info()
        except ShardRpcError:
            if loop.time() >= deadline:
                raise
            await asyncio.sleep(0.2)
