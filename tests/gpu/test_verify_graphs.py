"""Speculative decoding's verify steps in CUDA graphs (shard/runner/cuda_graphs.py, query_len > 1)
against the eager path: same logits for rows of different lengths, and padding tokens write no
K/V. Run on a GPU machine: `pytest -m gpu tests/gpu`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    from tests.helpers.models import tiny_model

    return tiny_model(tmp_path_factory, "llama")


def test_verify_graph_matches_eager_and_writes_only_real_slots(tiny_llama):
    from shard.distributed.groups import Dist
    from shard.runner.model_runner import StepInputs
    from shard.runner.warmup import WarmupSpec
    from shard.server.loader import Shard, ShardConfig

    shard = Shard(ShardConfig(model_id=str(tiny_llama), dtype="float32", device="cuda"), Dist())
    shard.warmup(WarmupSpec(64, 128, 128, 8, max_batch_total_tokens=2048, speculate_tokens=4,
                            speculate_max_batch_size=4))
    runner = shard.runner
    assert sorted(runner.verify_graphs) == [2, 3, 4, 5]
    bs = runner.block_size
    prompts = [[(7 * i + 3 * j + 1) % 500 for j in range(n)] for i, n in enumerate((21, 9, 33))]
    per = math.ceil(64 / bs)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    pre = StepInputs([], [], [], [], [], [])
    for p, t in zip(prompts, tables):
        pre.token_ids.extend(p)
        pre.positions.extend(range(len(p)))
        pre.query_lens.append(len(p))
        pre.seq_lens.append(len(p))
        pre.block_tables.append(t)
        pre.logits_indices.append(len(pre.token_ids) - 1)
    runner.execute(pre)
    # Verify rows of 1, 3 and 5 tokens (0, 2 and 4 drafts) continuing the cached prompts.
    q = [1, 3, 5]
    step = StepInputs([], [], [], [], [], [])
    for p, t, n in zip(prompts, tables, q):
        step.token_ids.extend([(11 * j + 5) % 500 for j in range(n)])
        step.positions.extend(range(len(p), len(p) + n))
        step.query_lens.append(n)
        step.seq_lens.append(len(p) + n)
        step.block_tables.append(t)
    step.logits_indices = list(range(sum(q)))
    key_cache = runner.kv_cache[0][0]  # layer 0's keys [num_blocks, block_size, heads, dim]
    before = key_cache.clone()
    d = runner.prepare(step)
    eager = runner.forward(d.input_ids, d.positions, d.meta, d.logits_indices).float().clone()
    written = (key_cache != before).flatten(2).any(-1)  # [num_blocks, block_size]
    key_cache.copy_(before)

    def no_eager(_step):
        raise AssertionError("the verify step ran eagerly")

    runner.prepare = no_eager  # the graph path never prepares
    graph = runner.execute(step).float()  # the verify graph of 5 tokens per row
    torch.cuda.synchronize()
    del runner.prepare
    assert (key_cache != before).flatten(2).any(-1).equal(written)  # padding wrote nothing
    assert int(written.sum()) == sum(q)
    assert torch.allclose(graph, eager, atol=1e-4, rtol=1e-4), (graph - eager).abs().max()
    assert graph.argmax(-1).tolist() == eager.argmax(-1).tolist()
