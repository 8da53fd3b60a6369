"""Router-side scheduling: request states, KV block manager, prefix cache, step contracts.

Plain Python over small dataclasses; no torch, no gRPC (see the design reference,
shared/DESIGN.md beside the repository: examples 1-4).
"""

from service.scheduler.block_manager import BlockManager
from service.scheduler.contracts import (
    ChunkWork,
    FinishInfo,
    GenerationOut,
    StepOutput,
    StepPlan,
)
from service.scheduler.prefix_cache import PrefixCache, block_digest
from service.scheduler.scheduler import ProtocolError, Scheduler, SchedulerConfig
from service.scheduler.speculation import NgramIndex, SpeculationConfig
from service.scheduler.state import RequestState, Sequence

__all__ = [
    "BlockManager",
    "ChunkWork",
    "FinishInfo",
    "GenerationOut",
    "NgramIndex",
    "PrefixCache",
    "ProtocolError",
    "RequestState",
    "Scheduler",
    "SchedulerConfig",
    "Sequence",
    "SpeculationConfig",
    "StepOutput",
    "StepPlan",
    "block_digest",
]
