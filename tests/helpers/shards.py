"""In-process shards (loader + engine, no gRPC) for the shard tests."""

from __future__ import annotations

from pathlib import Path

from shard.distributed.groups import Dist
from shard.runner.warmup import WarmupSpec
from shard.server.loader import Shard, ShardConfig


def make_shard(model_dir: Path, **config: object) -> Shard:
    """A one-rank shard of `model_dir` with a 1 MiB KV cache, warmed up for prompts up to 128
    tokens and batches up to 8 (ShardConfig fields in `config`, e.g. dtype, quantize)."""
    shard = Shard(ShardConfig(model_id=str(model_dir), kv_cache_memory_mb=1, **config), Dist())
    shard.warmup(WarmupSpec(128, 256, 256, 8, max_batch_total_tokens=2048))
    return shard
