"""What a shard says about its start-up: weight-loading progress and size, the rank's host
memory, warmup's phases (shard.layers.weights, shard.server.host_memory, shard.runner.warmup)."""

from __future__ import annotations

import logging
import mmap
import sys

import pytest
import torch
from torch import nn

from shard.distributed.groups import Dist
from shard.layers.weights import parameter_bytes, size_text
from shard.runner.warmup import WarmupSpec, warmup_prefill_spec
from shard.server.host_memory import read_host_memory
from shard.server.loader import Shard, ShardConfig


def test_parameter_bytes_counts_each_storage_once():
    """Tied and merged weights are views of one storage: counted once, not per view."""
    root = nn.Module()
    root.a = nn.Linear(8, 4, bias=False)  # 32 fp32 = 128 bytes
    root.b = nn.Linear(8, 4, bias=False)
    root.b.weight = root.a.weight  # tied: no new bytes
    merged = torch.zeros(6, 8)  # 192 bytes, two row-block views
    root.c, root.d = nn.Linear(8, 3, bias=False), nn.Linear(8, 3, bias=False)
    root.c.weight.data, root.d.weight.data = merged[:3], merged[3:]
    root.register_buffer("scale", torch.ones(4))  # 16 bytes
    assert parameter_bytes(root) == 128 + 192 + 16
    assert size_text(3 * 2**29) == "1.50 GiB" and size_text(5 * 2**19) == "2.5 MiB"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_host_memory_reports_this_process():
    """Anonymous memory grows by what the process writes; the peak never trails it."""
    size = 64 * 2**20
    before = read_host_memory()
    # A fresh private anonymous mapping, every page written: a tensor could be served from
    # memory the allocator already holds resident (then nothing grows: seen once in CI)
    block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
    block.write(b"\x01" * size)
    after = read_host_memory()
    assert before is not None and after is not None
    assert after.anon - before.anon > 48 * 2**20
    assert after.peak_rss >= after.anon + after.file + after.shmem - 2**20
    assert "GiB" in after.describe()
    block.close()


def test_load_and_warmup_log_their_phases(tiny_models, caplog):
    """The rank's log names the loaded bytes (the model's parameters, each storage once) and
    warmup's prefill, KV cache size and graph phase."""
    with caplog.at_level(logging.INFO):
        shard = Shard(ShardConfig(model_id=str(tiny_models["llama"]), kv_cache_memory_mb=4),
                      Dist())
        result = shard.warmup(WarmupSpec(64, 128, 128, 4))
    loaded = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights: ")]
    size = parameter_bytes(shard.runner.model)
    assert 2**18 < size < 2**30  # the tiny llama: under a MiB
    assert loaded and loaded[-1].startswith("weights: loaded in ")
    assert f"({size_text(size)} of parameters on cpu)" in loaded[-1]
    warm = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warmup: ")
            and "kernel tuning:" not in r.getMessage()]
    assert len(warm) == 1
    # The GEMV tuning report (shard/kernels/tuning_cache.py): nothing to tune on CPU.
    tuning = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith("warmup: kernel tuning: ")]
    assert len(tuning) == 1 and "0 shapes tuned, 0 read from the cache" in tuning[0]
    assert f"KV cache {result.num_blocks} blocks" in warm[0]
    assert "decode runs eagerly (no CUDA graphs)" in warm[0]


def test_cpu_warmup_prefill_is_capped_and_said(tiny_models, caplog):
    """On CPU the KV cache is sized from host memory, so warmup's prefill is capped (the full
    worst case cost minutes of a 2-core host's start-up) and the log says so; the router's limits
    still bound what is served."""
    with caplog.at_level(logging.INFO):
        shard = Shard(ShardConfig(model_id=str(tiny_models["llama"]), kv_cache_memory_mb=4),
                      Dist())
        result = shard.warmup(WarmupSpec(1000, 1024, 2048, 8))
    warm = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warmup: ")
            and "kernel tuning:" not in r.getMessage()]
    assert len(warm) == 1 and "prefill (capped on CPU) of 256 tokens" in warm[0]
    assert result.max_supported_total_tokens >= 1024
    # A spec already under the cap runs as given.
    spec = WarmupSpec(64, 128, 128, 4)
    assert warmup_prefill_spec(spec, torch.device("cpu")) is spec
    assert warmup_prefill_spec(WarmupSpec(1000, 1024, 2048, 8), torch.device("meta")) \
        .max_batch_prefill_tokens == 2048
