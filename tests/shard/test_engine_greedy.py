"""Greedy generation through the engine (convert + engine, no gRPC) equals transformers
generate() token for token, with requests joining and leaving between steps and chunked
prefill."""

from __future__ import annotations

import pytest
from reference import hf_greedy, load_hf, prompts
from shard_driver import RouterSim, engine_call

from tests.helpers.shards import make_shard

N = 32


def joining_and_leaving(sim: RouterSim, p: list[list[int]]) -> None:
    """A(17) + B(5) prefill; decode; C(45) chunked while A, B decode; B filtered out; D joins."""
    sim.add(1, p[0], N)
    sim.add(2, p[1], N)
    sim.prefill([(1, 0), (2, 0)])
    for _ in range(3):
        sim.decode()
    sim.add(3, p[2], N)
    sim.prefill([(3, 16)])
    sim.prefill([(3, 16)])
    sim.decode()  # C is mid-prefill: A and B decode, C waits
    sim.prefill([(3, 0)])
    for _ in range(5):
        sim.decode()
    sim.filter([1, 3])
    sim.add(4, p[3], 20)
    sim.prefill([(4, 0)])
    sim.run_to_completion()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gpt2"])
def test_greedy_matches_transformers(tiny_models, arch):
    model_dir = tiny_models[arch]
    shard = make_shard(model_dir)
    sim = RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)
    p = prompts(model_dir, [17, 5, 45, 30])
    joining_and_leaving(sim, p)
    hf = load_hf(model_dir)
    for rid, n in [(1, N), (3, N), (4, 20)]:
        req = sim.done[rid]
        assert req.finished is not None and req.finished.generated_tokens == n
        assert req.generated == hf_greedy(hf, p[rid - 1], n), f"request {rid}"
    cut = sim.done[2].generated
    assert 0 < len(cut) < N and cut == hf_greedy(hf, p[1], len(cut))
    assert shard.engine.requests == {} and shard.engine.batches == {}
