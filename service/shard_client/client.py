"""gRPC client of the shards: every RPC goes to every rank, rank 0's answer is read.

Timeouts on every call, so a wedged shard turns into an error instead of a hang.
"""

from __future__ import annotations

import asyncio
import time
from typing import TypeVar

import grpc
from tokenwire.shard.v1 import shard_pb2 as pb
from tokenwire.shard.v1 import shard_pb2_grpc as pb_grpc

from service.shard_client.convert import (
    ShardInfo,
    WarmupBudgets,
    WarmupInfo,
    shard_info,
    warmup_info,
    warmup_request,
)

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.max_receive_message_length", 256 << 20),
]

R = TypeVar("R")


class ShardClient:
    """Speaks tokenwire.shard.v1 to every rank of one deployment."""

    def __init__(
        self,
        urls: list[str],
        step_timeout_s: float = 120.0,
        control_timeout_s: float = 30.0,
        warmup_timeout_s: float = 1800.0,
    ) -> None:
        if not urls:
            raise ValueError("no shard urls")
        self.urls = list(urls)
        self.step_timeout_s = step_timeout_s
        self.control_timeout_s = control_timeout_s
        self.warmup_timeout_s = warmup_timeout_s
        self._channels = [grpc.aio.insecure_channel(u, options=_CHANNEL_OPTIONS) for u in urls]
        self._stubs = [pb_grpc.ShardServiceStub(c) for c in self._channels]

    async def _all(self, method: str, request: object, timeout: float) -> R:  # type: ignore[type-var]
        if len(self._stubs) == 1:
            return await getattr(self._stubs[0], method)(request, timeout=timeout)
        calls = [getattr(s, method)(request, timeout=timeout) for s in self._stubs]
        results = await asyncio.gather(*calls)
        return results[0]

    async def info(self) -> pb.InfoResponse:
        return await self._stubs[0].Info(pb.InfoRequest(), timeout=self.control_timeout_s)

    async def health(self) -> None:
        await self._all("Health", pb.HealthRequest(), self.control_timeout_s)

    async def warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        return await self._all("Warmup", request, self.warmup_timeout_s)

    async def prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        return await self._all("Prefill", request, self.step_timeout_s)

    async def decode(self, request: pb.DecodeRequest) -> pb.DecodeResponse:
        return await self._all("Decode", request, self.step_timeout_s)

    async def filter_batch(self, request: pb.FilterBatchRequest) -> pb.FilterBatchResponse:
        return await self._all("FilterBatch", request, self.control_timeout_s)

    async def clear_cache(self, batch_id: int | None = None) -> None:
        req = pb.ClearCacheRequest() if batch_id is None else pb.ClearCacheRequest(id=batch_id)
        await self._all("ClearCache", req, self.control_timeout_s)

    async def close(self) -> None:
        for c in self._channels:
            await c.close()


async def _wait_healthy(target: str, timeout_s: float) -> None:
    """Waits until the shard at `target` answers Health (it may still be starting)."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.ShardServiceStub(channel)
        while True:
            left = deadline - time.monotonic()
            try:
                await stub.Health(pb.HealthRequest(), timeout=max(0.1, min(5.0, left)))
                return
            except grpc.aio.AioRpcError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.1)


async def connect_and_warmup(
    shard_target: str,
    budgets: WarmupBudgets,
    connect_timeout_s: float = 60.0,
    step_timeout_s: float = 120.0,
) -> tuple[ShardClient, WarmupInfo, ShardInfo]:
    """Connects to rank 0 at `shard_target`, discovers every rank, clears old state and warms
    them all up with `budgets`. Returns the client with the KV cache facts and the model info."""
    await _wait_healthy(shard_target, connect_timeout_s)
    async with grpc.aio.insecure_channel(shard_target) as channel:
        stub = pb_grpc.ShardServiceStub(channel)
        disc = await stub.ServiceDiscovery(pb.ServiceDiscoveryRequest(), timeout=connect_timeout_s)
    urls = list(disc.urls) or [shard_target]
    for url in urls[1:]:
        await _wait_healthy(url, connect_timeout_s)
    client = ShardClient(urls, step_timeout_s=step_timeout_s)
    try:
        info = shard_info(await client.info())
        await client.clear_cache()
        warm = warmup_info(await client.warmup(warmup_request(budgets)))
    except BaseException:
        await client.close()
        raise
    return client, warm, info
