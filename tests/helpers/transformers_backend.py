"""What the transformers-backend tests share: a shard of a model forced through the backend,
its greedy tokens on the runner (batched prefill, then decode steps), and the per-rank job of
the two-rank (gloo) test, which loops over every model in one pair of processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shard.distributed.groups import Dist
from shard.runner.warmup import WarmupSpec
from shard.server.loader import Shard, ShardConfig
from shard.testing.tiny import greedy_tokens

STEPS = 10  # decode steps of the greedy checks


def backend_shard(model_dir: Path, dist: Dist | None = None, **config: Any) -> Shard:
    """A warmed-up CPU shard of model_dir served by the transformers backend (float32)."""
    config.setdefault("model_impl", "transformers")
    shard = Shard(ShardConfig(model_id=str(model_dir), kv_cache_memory_mb=2, **config),
                  dist or Dist())
    shard.warmup(WarmupSpec(128, 256, 256, 8, max_batch_total_tokens=2048))
    return shard


def greedy_rank(dist: Dist, device: str, job: dict[str, Any], res: dict[str, Any]) -> None:
    """shard.testing.ranks RankFn: per model of job["dirs"] {name: dir}, the greedy tokens
    (res["tokens"][name]) and how many weights this rank holds (res["params"][name]: fewer
    than one shard's when the model was split, not replicated)."""
    import torch

    torch.set_num_threads(1)  # two ranks on a shared host: no oversubscribed OpenMP spinning
    for name, model_dir in job["dirs"].items():
        shard = backend_shard(Path(model_dir), dist)
        res.setdefault("tokens", {})[name] = greedy_tokens(shard, STEPS)
        res.setdefault("params", {})[name] = held_weights(shard)


def held_weights(shard: Shard) -> int:
    """Number of weight elements this rank's model holds."""
    return sum(p.numel() for p in shard.runner.model.hf.parameters())
