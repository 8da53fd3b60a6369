"""How a grouped-query attention layer's heads are split over tensor-parallel ranks.

Query heads are always split evenly: rank r owns query heads [r * H/W, (r + 1) * H/W) of H heads
on W ranks. Key/value heads follow one of two layouts:
- split: KV heads (K) divide evenly over the ranks (K % W == 0): rank r owns K/W of them;
- replicated: fewer KV heads than ranks (W % K == 0, multi-query and narrow GQA models): each KV
  head is loaded by the W/K consecutive ranks whose query heads read it, so every rank holds
  exactly one KV head and its cache.
Rank r's query heads must all read KV heads this rank holds; both layouts guarantee it (query
head h reads KV head h // (H/K)).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadPartition:
    """One rank's share of an attention layer's heads."""

    local_heads: int  # query heads on this rank
    local_kv_heads: int  # KV heads on this rank (cache width)
    # The K/V projections' output rows are cut into kv_parts equal parts; this rank loads part
    # kv_part. Split layout: (rank, world); replicated: (the one KV head this rank reads, K).
    kv_part: int
    kv_parts: int


def splits(num_heads: int, num_kv_heads: int, world_size: int) -> bool:
    """Whether the heads can be split over world_size ranks (see the module docstring)."""
    if world_size < 1 or num_heads % world_size:
        return False
    return num_kv_heads % world_size == 0 or world_size % num_kv_heads == 0


def workable_world_sizes(num_heads: int, num_kv_heads: int) -> list[int]:
    """Every world size the heads split over (each divides num_heads), ascending."""
    return [w for w in range(1, num_heads + 1) if splits(num_heads, num_kv_heads, w)]


def partition_heads(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> HeadPartition:
    """This rank's heads; ValueError naming the head counts and the world sizes that work when
    they cannot be split over world_size ranks."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"{num_heads} query heads are not a multiple of {num_kv_heads} key/value heads"
        )
    if not splits(num_heads, num_kv_heads, world_size):
        works = ", ".join(map(str, workable_world_sizes(num_heads, num_kv_heads)))
        raise ValueError(
            f"this model's {num_heads} query heads / {num_kv_heads} key/value heads cannot be "
            f"split over {world_size} ranks (query heads must divide evenly over the ranks, and "
            f"the ranks evenly over the key/value heads or the heads over the ranks); "
            f"--num-shard values that work: {works}"
        )
    local_heads = num_heads // world_size
    if num_kv_heads % world_size == 0:
        return HeadPartition(local_heads, num_kv_heads // world_size, rank, world_size)
    # Replicated: ranks [k * W/K, (k + 1) * W/K) read KV head k.
    return HeadPartition(local_heads, 1, rank // (world_size // num_kv_heads), num_kv_heads)
