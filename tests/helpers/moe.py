"""Shards of the native MoE families for the tests (tests/shard/test_moe.py), and the rank job
of their two-rank parity test (pickled by name into shard.testing.ranks' processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shard.distributed.groups import Dist
from shard.runner.warmup import WarmupSpec
from shard.server.loader import Shard, ShardConfig

MOE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]
STEPS = 8  # greedy decode steps of the two-rank check


def moe_shard(model_dir: Path, dist: Dist | None = None, **config: Any) -> Shard:
    """A warmed-up CPU shard of model_dir (float32) under --model-impl auto, which serves the
    MoE families natively (the tests assert it)."""
    config.setdefault("model_impl", "auto")
    shard = Shard(ShardConfig(model_id=str(model_dir), kv_cache_memory_mb=2, **config),
                  dist or Dist())
    shard.warmup(WarmupSpec(64, 128, 128, 4, max_batch_total_tokens=512))
    return shard


def moe_greedy_rank(dist: Dist, device: str, job: dict[str, Any], res: dict[str, Any]) -> None:
    """shard.testing.ranks RankFn: per model of job["dirs"], the greedy tokens and this rank's
    share of the experts' intermediate features."""
    import torch

    from shard.layers.moe import FusedMoE
    from shard.testing.tiny import greedy_tokens

    torch.set_num_threads(1)
    for name, model_dir in job["dirs"].items():
        shard = moe_shard(Path(model_dir), dist)
        res.setdefault("tokens", {})[name] = greedy_tokens(shard, STEPS)
        assert shard.info.model_impl == "native", name
        experts = next(m for m in shard.runner.model.modules() if isinstance(m, FusedMoE))
        res.setdefault("inter_local", {})[name] = experts.inter_local
