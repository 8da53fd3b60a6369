"""The fused-residual forward (the CUDA path: row-parallel outputs left un-reduced and summed by
the next norm, `layers.reduce_add_rms_norm`) computes exactly what the plain forward does, on one
rank and on two (gloo), so the GPU's fused all-reduce + add + RMSNorm kernel slots into a
forward whose structure is checked here."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from test_quantization_shard import prefill_logits

from shard.distributed.groups import Dist, init_distributed, shutdown_distributed
from shard.layers.linear import RowParallelLinear
from shard.layers.norm import RMSNorm, reduce_add_rms_norm
from shard.server.loader import Shard, ShardConfig
from shard.runner.model_runner import StepInputs
from tests.helpers.ports import free_port

PROMPT = [5, 17, 3, 42, 8, 11, 29, 64, 2, 7, 19, 33]


def both_forwards(shard: Shard) -> tuple[torch.Tensor, torch.Tensor]:
    """(plain, fused) logits: [n + 1, vocab], every prompt row, then the last row computed
    alone (only the logits rows are reduced and normalized)."""
    model = shard.runner.model
    shard.runner.allocate_kv_cache(8)
    n = len(PROMPT)
    out = []
    for fused in (False, True):
        model.fused_residual = fused
        last = shard.runner.execute(StepInputs(PROMPT, list(range(n)), [n], [n], [[0]], [n - 1]))
        out.append(torch.cat([prefill_logits(shard, PROMPT), last]))
    model.fused_residual = False
    return out[0], out[1]


@pytest.mark.parametrize("model", ["llama", "qwen2", "mistral"])
def test_fused_residual_forward_equals_plain(tiny_models, model):
    shard = Shard(ShardConfig(model_id=str(tiny_models[model]), kv_cache_memory_mb=1), Dist())
    plain, fused = both_forwards(shard)
    assert torch.equal(plain, fused)


def _rank_main(rank: int, port: int, model_dir: str, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist = init_distributed(rank, 2, "127.0.0.1", port, torch.device("cpu"))
    try:
        # A biased row-parallel linear: partial() counts the bias once (rank 0), so the reduced
        # sum equals forward()'s all-reduce + bias.
        torch.manual_seed(0)
        full_w, bias = torch.randn(16, 8), torch.randn(16)
        x_full = torch.randn(3, 8)
        lin = RowParallelLinear(8, 16, True, dist)
        lin.weight.data = full_w[:, rank * 4 : (rank + 1) * 4].clone()
        lin.bias.data = bias
        x = x_full[:, rank * 4 : (rank + 1) * 4]
        norm = RMSNorm(16, 1e-6)
        norm.weight.data = torch.rand(16) + 0.5
        residual = torch.randn(3, 16)
        h, s = reduce_add_rms_norm(dist, lin.partial(x), residual, norm)
        want_s = residual + lin(x)
        linear_ok = torch.allclose(s, want_s, atol=1e-5) and torch.allclose(
            h, norm(want_s), atol=1e-5
        )
        shard = Shard(ShardConfig(model_id=model_dir, kv_cache_memory_mb=1), dist)
        plain, fused = both_forwards(shard)
        # numpy copies travel by value: a torch tensor would travel as a shared-memory fd that
        # dies with this process if it exits before the parent has read the queue.
        out.put((rank, linear_ok, plain.numpy(), fused.numpy()))
    finally:
        shutdown_distributed()


@pytest.mark.slow
def test_fused_residual_forward_two_ranks(tiny_models):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, str(tiny_models["llama"]), out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(2):
            rank, linear_ok, plain, fused = out.get(timeout=120)
            results[rank] = (linear_ok, torch.from_numpy(plain), torch.from_numpy(fused))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    single = Shard(ShardConfig(model_id=str(tiny_models["llama"]), kv_cache_memory_mb=1), Dist())
    reference, _ = both_forwards(single)
    for rank, (linear_ok, plain, fused) in results.items():
        assert linear_ok, f"rank {rank}: partial() + reduce_add_rms_norm != forward() + add"
        assert torch.equal(plain, fused), f"rank {rank}"
        torch.testing.assert_close(plain, reference, atol=1e-4, rtol=1e-4)
    assert torch.equal(results[0][1], results[1][1])  # ranks agree
