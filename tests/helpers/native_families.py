"""What the native-family tests share: the tiny checkpoints of each family (configs chosen so
each quirk is exercised) and the per-rank job of their two-rank (gloo) test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shard.distributed.groups import Dist
from shard.runner.warmup import WarmupSpec
from shard.server.loader import Shard, ShardConfig
from shard.testing.tiny import greedy_tokens

# Decode steps of the greedy checks: the 45-token prompt stays within Phi-3's original context
# (its LongRoPE short factors; tests/shard/test_native_families.py checks the long ones).
STEPS = 16
LONGROPE_ORIGINAL = 64

# What differs from shard/tools/tiny_any.py's common shape (hidden 64, 4 query / 2 KV heads).
FAMILIES: dict[str, dict[str, Any]] = {
    # head_dim 32 != hidden / heads (16); tied embeddings as on Qwen3-0.6B to 4B.
    "qwen3": {"head_dim": 32, "tie_word_embeddings": True},
    # One KV head: at two ranks k's projection norm is over a KV head both ranks hold.
    "olmo2": {"num_key_value_heads": 1},
    # LongRoPE with distinct short and long factors and the default attention factor.
    "phi3": {
        "original_max_position_embeddings": LONGROPE_ORIGINAL,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [1.0 + 0.9 * i for i in range(8)],
        },
    },
}


def native_shard(model_dir: Path, dist: Dist | None = None, **config: Any) -> Shard:
    """A warmed-up CPU shard of model_dir (float32), native code unless config says otherwise."""
    config.setdefault("model_impl", "native")
    shard = Shard(ShardConfig(model_id=str(model_dir), kv_cache_memory_mb=2, **config),
                  dist or Dist())
    shard.warmup(WarmupSpec(128, 256, 256, 8, max_batch_total_tokens=2048))
    return shard


def held_weights(shard: Shard) -> int:
    """Number of weight elements this rank's model holds (tied and merged weights once)."""
    seen: set[int] = set()
    total = 0
    for p in shard.runner.model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel()
    return total


def native_greedy_rank(dist: Dist, device: str, job: dict[str, Any], res: dict[str, Any]) -> None:
    """shard.testing.ranks RankFn: per model of job["dirs"] {name: dir}, the native greedy
    tokens (res["tokens"][name]) and the weights this rank holds (res["params"][name])."""
    import torch

    torch.set_num_threads(1)  # two ranks on a shared host: no oversubscribed OpenMP spinning
    for name, model_dir in job["dirs"].items():
        shard = native_shard(Path(model_dir), dist)
        res.setdefault("tokens", {})[name] = greedy_tokens(shard, STEPS)
        res.setdefault("params", {})[name] = held_weights(shard)
