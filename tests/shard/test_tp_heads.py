"""Splitting attention heads over tensor-parallel ranks (shard/models/heads.py): KV heads split
or replicated, the start-up error for head counts that do not split, and which checkpoint rows
each rank's K/V projections load (built per rank in one process: loading needs no collective)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from shard.attention import get_backend
from shard.distributed.groups import Dist
from shard.models import LoadContext
from shard.models.heads import HeadPartition, partition_heads, workable_world_sizes
from shard.models.llama import LlamaForCausalLM
from shard.tools.tiny_model import TinyModelSpec, make_tiny_model


def test_kv_heads_split_when_they_divide_over_ranks():
    assert partition_heads(32, 8, 3, 4) == HeadPartition(8, 2, 3, 4)
    assert partition_heads(4, 2, 1, 2) == HeadPartition(2, 1, 1, 2)


@pytest.mark.parametrize(
    ("heads", "kv", "world", "expected_parts"),
    [
        (4, 1, 2, [0, 0]),  # multi-query: every rank holds the one KV head
        (8, 1, 8, [0] * 8),
        (8, 2, 4, [0, 0, 1, 1]),  # narrow GQA: ranks 0-1 read KV head 0, ranks 2-3 head 1
        (16, 2, 8, [0, 0, 0, 0, 1, 1, 1, 1]),
        (9, 3, 9, [0, 0, 0, 1, 1, 1, 2, 2, 2]),
    ],
)
def test_kv_heads_replicated_when_fewer_than_ranks(heads, kv, world, expected_parts):
    parts = [partition_heads(heads, kv, r, world) for r in range(world)]
    assert [p.kv_part for p in parts] == expected_parts
    assert all(p.local_kv_heads == 1 and p.kv_parts == kv for p in parts)
    assert all(p.local_heads == heads // world for p in parts)
    # Every query head a rank owns reads the KV head that rank holds (h // (heads / kv)).
    group = heads // kv
    for r, p in enumerate(parts):
        owned = range(r * p.local_heads, (r + 1) * p.local_heads)
        assert {h // group for h in owned} == {p.kv_part}


def test_heads_that_do_not_split_name_counts_and_working_sizes():
    # SmolLM2-135M: 9 query heads, 3 KV heads.
    assert workable_world_sizes(9, 3) == [1, 3, 9]
    with pytest.raises(ValueError) as err:
        partition_heads(9, 3, 0, 2)
    assert str(err.value) == (
        "this model's 9 query heads / 3 key/value heads cannot be split over 2 ranks (query "
        "heads must divide evenly over the ranks, and the ranks evenly over the key/value heads "
        "or the heads over the ranks); --num-shard values that work: 1, 3, 9"
    )
    # 12 heads / 4 KV heads on 6 ranks: query heads split, but a rank's 2 query heads would
    # straddle KV heads (6 is neither a multiple nor a divisor of 4).
    assert workable_world_sizes(12, 4) == [1, 2, 4, 12]
    with pytest.raises(
        ValueError,
        match="12 query heads / 4 key/value heads cannot be split "
        "over 6 ranks.*values that work: 1, 2, 4, 12$",
    ):
        partition_heads(12, 4, 5, 6)


def _load(model_dir: Path, rank: int, world: int) -> LlamaForCausalLM:
    config = json.loads((model_dir / "config.json").read_text())
    cpu = torch.device("cpu")
    ctx = LoadContext(
        model_dir, config, cpu, torch.float32, Dist(rank, world), get_backend("auto", cpu)
    )
    return LlamaForCausalLM(ctx)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: K/V biases follow the heads
def test_each_rank_loads_the_kv_head_its_queries_read(tmp_path, arch):
    model_dir = make_tiny_model(
        tmp_path, TinyModelSpec(arch=arch, num_layers=1, num_heads=8, num_kv_heads=2)
    )
    head_dim = 64 // 8
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        full = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118 - not a dict
    names = ["k_proj.weight", "v_proj.weight"] + (
        ["k_proj.bias", "v_proj.bias"] if arch == "qwen2" else []
    )
    single = _load(model_dir, 0, 1)
    for rank in range(4):
        model = _load(model_dir, rank, 4)
        attn = model.model.layers[0].self_attn
        assert (attn.attn.num_heads, attn.attn.num_kv_heads) == (2, 1)
        kv_head = rank // 2
        for name in names:
            part, param = name.split(".")
            got = attn.qkv_proj.parts[part].get_parameter(param)
            rows = full[f"model.layers.0.self_attn.{name}"][
                kv_head * head_dim : (kv_head + 1) * head_dim
            ]
            assert torch.equal(got, rows), (rank, name)
        # KV cache per rank: one KV head, half of the single shard's two.
        assert model.kv_bytes_per_block(16) * 2 == single.kv_bytes_per_block(16)


def test_model_whose_heads_do_not_split_fails_at_load(tmp_path):
    model_dir = make_tiny_model(tmp_path, TinyModelSpec(arch="llama", num_layers=1))  # 4 / 2
    with pytest.raises(
        ValueError,
        match=r"4 query heads / 2 key/value heads cannot be split "
        r"over 3 ranks.*values that work: 1, 2, 4$",
    ):
        _load(model_dir, 0, 3)
