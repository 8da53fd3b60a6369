"""What the engine needs of the shards, in domain terms: the backend protocol and its facts.

The engine owns this interface; `service.shard_client.ShardClient` implements it over
`tokenwire.shard.v1` gRPC (all protobuf conversion happens there), so nothing in `service.engine`
sees a proto or a gRPC error. Data flow of one step:

    Scheduler.schedule() -> StepPlan -> ShardBackend.step(plan) -> StepOutput -> apply_output()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from service.engine.adapters import AdapterInfo, AdapterSource
from service.scheduler.contracts import StepOutput, StepPlan


class ShardRpcError(Exception):
    """A shard RPC failed or timed out. `status` is the gRPC status name ("UNAVAILABLE",
    "DEADLINE_EXCEEDED", ...); the message reads "shard RPC failed: STATUS: details"."""

    def __init__(self, status: str, details: str | None) -> None:
        super().__init__(f"shard RPC failed: {status}: {details}")
        self.status = status
        self.details = details

    @property
    def unreachable(self) -> bool:
        """True when the shard refused or lost the connection (not merely slow or failing)."""
        return self.status == "UNAVAILABLE"


class ShardBackend(Protocol):
    """The shards as the engine drives them (timeouts included: a wedged shard raises
    ShardRpcError instead of hanging). The backend tracks the shard's running batch itself."""

    # Router-side CPU seconds spent so far building requests and reading answers (not waiting
    # for the shard): the engine counts it as step work in its stats.
    cpu_seconds: float
    # Overlapped steps (the engine sets it with EngineConfig.overlap): `step` may be called
    # again before the previous call returned; the backend keeps the steps in call order and
    # tracks the running batch from what it sent.
    overlap: bool

    async def step(self, plan: StepPlan) -> StepOutput:
        """Runs one step: the plan's prefill chunks fused with the decode of the running batch
        (Prefill), or a decode of the running batch alone (Decode)."""
        ...

    async def filter(self, keep_ids: list[int]) -> None:
        """Makes the shard forget every request of its running batch not in `keep_ids` (all of
        them when empty) and free their state."""
        ...

    async def load_adapter(self, source: AdapterSource) -> AdapterInfo:
        """Loads a LoRA adapter on every rank, or on none (ShardRpcError: INVALID_ARGUMENT or
        FAILED_PRECONDITION when the shards refuse it, naming the problem)."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Unloads a LoRA adapter on every rank (ShardRpcError FAILED_PRECONDITION while
        requests on a rank still use it; NOT_FOUND on a rank is ignored)."""
        ...


@dataclass(frozen=True)
class WarmupBudgets:
    """Budgets the shard must support (its Warmup)."""

    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_size: int
    max_batch_total_tokens: int | None = None
    speculate_tokens: int = 0  # most draft tokens per request and step
    speculate_max_batch_size: int = 0  # largest step carrying drafts


@dataclass(frozen=True)
class WarmupInfo:
    """Result of Warmup: the KV cache the router now owns."""

    num_blocks: int
    block_size: int
    max_supported_total_tokens: int
    warmup_ns: int


@dataclass(frozen=True)
class ShardDescription:
    """Static facts the shard reports about itself and its model (its Info RPC)."""

    model_id: str
    model_type: str
    dtype: str
    device_type: str
    block_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    world_size: int
    sliding_window: int | None
    attention_backend: str
    model_sha: str | None
    max_loras: int = 0  # LoRA adapter device slots (0: LoRA off)
    max_lora_rank: int = 0
    adapters: tuple[AdapterInfo, ...] = ()
    model_impl: str = "native"  # "native" | "transformers" (the transformers backend)
    cuda_graphs: bool = False  # decode steps replay CUDA graphs  # loaded when Info was read (start-up adapters)
