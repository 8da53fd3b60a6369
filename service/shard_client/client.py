"""gRPC client of the shards: every RPC goes to every rank, rank 0's answer is read.

Speaks `tokenwire.shard.v1` on the wire and domain types to its callers: it implements the
engine's `service.engine.backend.ShardBackend` (StepPlan in, StepOutput out) and tracks the
shard's running batch (TGI v3's cached batch id) itself. Every failed or timed-out RPC becomes a
`ShardRpcError`. Timeouts on every call, so a wedged shard turns into an error instead of a hang.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import grpc
from tokenwire.shard.v1 import shard_pb2 as pb
from tokenwire.shard.v1 import shard_pb2_grpc as pb_grpc

from service.engine.adapters import AdapterInfo, AdapterSource
from service.engine.backend import ShardDescription, ShardRpcError, WarmupBudgets, WarmupInfo
from service.scheduler.contracts import StepOutput, StepPlan
from service.shard_client import convert

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.max_receive_message_length", 256 << 20),
]


# How long one batch step may take on the shards before they are taken for down: far above
# any real step (an 8,192-token prefill step of the Llama-3-8B shape took 77 ms on an H100,
# benchmarks/OVERLAP.md), short of hanging clients forever on a wedged shard. The router's
# --shard-step-timeout.
DEFAULT_STEP_TIMEOUT_S = 120.0


def _rpc_error(error: grpc.aio.AioRpcError) -> ShardRpcError:
    return ShardRpcError(error.code().name, error.details())


class ShardClient:
    """Speaks tokenwire.shard.v1 to every rank of one deployment."""

    def __init__(
        self,
        urls: list[str],
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
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
        # The shard's running batch (one id) and its requests, as its last answer reported them.
        self._batch_ids = itertools.count(1)
        self._batch_id: int | None = None
        self._batch_request_ids: list[int] = []
        self.cpu_seconds = 0.0  # ShardBackend: request building and answer reading
        # Overlapped steps (the engine's --overlap): each step carries step_index and may be
        # sent before the previous answer is read; the running batch is then tracked from what
        # was sent (new chunks join it), minus what answers finished and filters removed.
        self.overlap = False
        self._step_index = 0

    async def _all(self, method: str, request: object, timeout: float) -> Any:
        try:
            if len(self._stubs) == 1:
                return await getattr(self._stubs[0], method)(request, timeout=timeout)
            calls = [getattr(s, method)(request, timeout=timeout) for s in self._stubs]
            results = await asyncio.gather(*calls)
            return results[0]
        except grpc.aio.AioRpcError as error:
            raise _rpc_error(error) from error

    # --- control -------------------------------------------------------------------------------
    async def info(self) -> ShardDescription:
        """Rank 0's Info."""
        try:
            reply = await self._stubs[0].Info(pb.InfoRequest(), timeout=self.control_timeout_s)
        except grpc.aio.AioRpcError as error:
            raise _rpc_error(error) from error
        return convert.shard_description(reply)

    async def health(self) -> None:
        await self._all("Health", pb.HealthRequest(), self.control_timeout_s)

    async def warmup(self, budgets: WarmupBudgets) -> WarmupInfo:
        reply = await self._all("Warmup", convert.warmup_request(budgets), self.warmup_timeout_s)
        return convert.warmup_info(reply)

    async def clear_cache(self) -> None:
        """Every rank forgets every batch (before warmup: state left by an earlier router)."""
        await self._all("ClearCache", convert.clear_cache_request(None), self.control_timeout_s)
        self._batch_id = None
        self._batch_request_ids = []
        self._step_index = 0

    # --- ShardBackend --------------------------------------------------------------------------
    async def step(self, plan: StepPlan) -> StepOutput:
        """Runs one step. With `overlap`, the request is built and sent before the first
        await, so the engine may start the next step's call before this one's answer."""
        t0 = time.thread_time()
        cached_ids = self._batch_request_ids
        if plan.finishing:  # finish in the step in flight: left out of this one's batch
            gone = set(plan.finishing)
            cached_ids = [r for r in cached_ids if r not in gone]
        if plan.chunks:
            new_id = next(self._batch_ids)
            request = convert.prefill_request(plan, new_id, self._batch_id, cached_ids)
            method = "Prefill"
            if self.overlap:  # the shard merges the chunks into the new batch
                known = set(cached_ids)
                self._batch_request_ids = cached_ids + [
                    c.seq_id for c in plan.chunks if c.seq_id not in known
                ]
                self._batch_id = new_id
        else:
            assert self._batch_id is not None
            request = convert.decode_request(plan, self._batch_id, cached_ids)
            method = "Decode"
            if self.overlap:
                self._batch_request_ids = cached_ids
        if self.overlap:
            self._step_index += 1
            request.step_index = self._step_index
        t1 = time.thread_time()
        reply = await self._all(method, request, self.step_timeout_s)
        t2 = time.thread_time()
        out = convert.step_output(reply)
        if self.overlap:
            done = {g.seq_id for g in out.generations if g.finish is not None}
            if done:
                self._batch_request_ids = [r for r in self._batch_request_ids if r not in done]
        else:
            self._batch_id = out.batch_id
            self._batch_request_ids = out.batch_request_ids
        self.cpu_seconds += (t1 - t0) + (time.thread_time() - t2)
        return out

    async def filter(self, keep_ids: list[int]) -> None:
        if self._batch_id is None:
            return
        if keep_ids:
            try:
                reply = await self._all(
                    "FilterBatch",
                    convert.filter_request(self._batch_id, keep_ids),
                    self.control_timeout_s,
                )
            except ShardRpcError as error:
                # Overlap: every request of the batch finished at a step whose answer is not
                # read yet, and the shard dropped the batch.
                if not (self.overlap and error.status == "NOT_FOUND"):
                    raise
                self._batch_request_ids = []
                return
            self._batch_request_ids = list(reply.batch.request_ids)
        else:
            await self._all(
                "ClearCache", convert.clear_cache_request(self._batch_id), self.control_timeout_s
            )
            self._batch_id = None
            self._batch_request_ids = []

    async def load_adapter(self, source: AdapterSource) -> AdapterInfo:
        """Every rank reads its slice; when any rank refuses, the others drop the adapter again
        (no rank keeps a half-loaded deployment's adapter)."""
        request = convert.load_adapter_request(source)
        calls = [s.LoadAdapter(request, timeout=self.warmup_timeout_s) for s in self._stubs]
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            if len(errors) < len(results):
                await self._unload_quietly(source.name)
            error = errors[0]
            if isinstance(error, grpc.aio.AioRpcError):
                raise _rpc_error(error) from error
            raise error
        return convert.adapter_info(results[0].adapter)  # type: ignore[union-attr]

    async def unload_adapter(self, name: str) -> None:
        request = pb.UnloadAdapterRequest(name=name)
        calls = [s.UnloadAdapter(request, timeout=self.control_timeout_s) for s in self._stubs]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, grpc.aio.AioRpcError):
                if result.code() != grpc.StatusCode.NOT_FOUND:
                    raise _rpc_error(result) from result
            elif isinstance(result, BaseException):
                raise result

    async def _unload_quietly(self, name: str) -> None:
        request = pb.UnloadAdapterRequest(name=name)
        await asyncio.gather(
            *(s.UnloadAdapter(request, timeout=self.control_timeout_s) for s in self._stubs),
            return_exceptions=True,
        )

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
            except grpc.aio.AioRpcError as error:
                if time.monotonic() >= deadline:
                    raise _rpc_error(error) from error
                await asyncio.sleep(0.1)


async def connect_and_warmup(
    shard_target: str,
    budgets: WarmupBudgets,
    connect_timeout_s: float = 60.0,
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
) -> tuple[ShardClient, WarmupInfo, ShardDescription]:
    """Connects to rank 0 at `shard_target`, discovers every rank, clears old state and warms
    them all up with `budgets`. Returns the client with the KV cache facts and the model info."""
    await _wait_healthy(shard_target, connect_timeout_s)
    async with grpc.aio.insecure_channel(shard_target) as channel:
        stub = pb_grpc.ShardServiceStub(channel)
        try:
            disc = await stub.ServiceDiscovery(
                pb.ServiceDiscoveryRequest(), timeout=connect_timeout_s
            )
        except grpc.aio.AioRpcError as error:
            raise _rpc_error(error) from error
    urls = list(disc.urls) or [shard_target]
    for url in urls[1:]:
        await _wait_healthy(url, connect_timeout_s)
    client = ShardClient(urls, step_timeout_s=step_timeout_s)
    try:
        info = await client.info()
        await client.clear_cache()
        warm = await client.warmup(budgets)
    except BaseException:
        await client.close()
        raise
    return client, warm, info


def shard_answers_health(target: str, timeout: float) -> bool:
    """True when the shard at `target` answers its Health RPC (blocking; for the launcher)."""
    with grpc.insecure_channel(target) as channel:
        try:
            pb_grpc.ShardServiceStub(channel).Health(pb.HealthRequest(), timeout=timeout)
            return True
        except grpc.RpcError:
            return False
