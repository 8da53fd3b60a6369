"""Seeded sampling through the engine (reproducible, independent of batch mates) and logprobs
equal to log_softmax of the transformers reference logits."""

from __future__ import annotations

import math

import pytest
import torch
from reference import load_hf, prompts
from shard_driver import RouterSim, engine_call
from test_engine_greedy import make_shard
from tokenwire.shard.v1 import shard_pb2 as pb


def sampled(seed: int) -> pb.SamplingParameters:
    return pb.SamplingParameters(
        do_sample=True, temperature=1.3, top_k=0, top_p=0.95, typical_p=1.0,
        repetition_penalty=1.0, seed=seed,
    )


@pytest.fixture(scope="module")
def llama(tiny_models):
    model_dir = tiny_models["llama"]
    return model_dir, make_shard(model_dir)


def new_sim(shard) -> RouterSim:
    shard.engine.clear_cache(None)
    return RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)


def test_seeded_sampling_reproducible_and_independent_of_batch_mates(llama):
    model_dir, shard = llama
    p = prompts(model_dir, [12, 30, 7, 21])
    sim = new_sim(shard)
    sim.add(1, p[0], 24, sampling=sampled(42))
    sim.prefill([(1, 0)])
    sim.run_to_completion()
    alone = sim.done[1].generated
    assert len(alone) == 24

    sim = new_sim(shard)  # same request amid others, joining at other times, chunked prefill
    sim.add(7, p[1], 24, sampling=sampled(7))
    sim.add(8, p[2], 10)
    sim.prefill([(7, 0), (8, 0)])
    sim.decode()
    sim.add(1, p[0], 24, sampling=sampled(42))
    sim.add(9, p[3], 24, sampling=sampled(42))  # same seed, other prompt
    sim.prefill([(1, 5), (9, 0)])
    sim.decode()
    sim.prefill([(1, 0)])
    sim.run_to_completion()
    assert sim.done[1].generated == alone
    assert sim.done[1].finished.seed == 42
    assert sim.done[7].generated != alone[: len(sim.done[7].generated)]

    sim = new_sim(shard)
    sim.add(1, p[0], 24, sampling=sampled(43))
    sim.prefill([(1, 0)])
    sim.run_to_completion()
    assert sim.done[1].generated != alone  # the seed matters


def test_logprobs_match_reference(llama):
    model_dir, shard = llama
    hf = load_hf(model_dir)
    p = prompts(model_dir, [37, 9])
    sim = new_sim(shard)
    sim.add(1, p[0], 12, prefill_logprobs=True, top_n=3)  # chunked: 16 + 16 + 5
    sim.add(2, p[1], 12, sampling=sampled(5), top_n=2, prefill_logprobs=True)
    sim.prefill([(1, 16), (2, 0)])
    sim.prefill([(1, 16)])
    sim.prefill([(1, 0)])
    sim.run_to_completion()
    for rid, prompt in [(1, p[0]), (2, p[1])]:
        req = sim.done[rid]
        seq = prompt + req.generated
        with torch.inference_mode():
            logits = hf(torch.tensor([seq])).logits[0].float()  # [len, vocab]
        ref = torch.log_softmax(logits, dim=-1)
        prefill = [g for g in req.generations if g.HasField("prefill_tokens")]
        assert len(prefill) == 1 and prefill[0] is req.generations[0]
        pt = prefill[0].prefill_tokens
        assert list(pt.ids) == prompt and math.isnan(pt.logprobs[0])
        expect = [ref[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
        assert max(abs(a - b) for a, b in zip(pt.logprobs[1:], expect)) < 1e-4
        assert len(pt.texts) == len(prompt)
        for k, gen in enumerate(req.generations):
            pos = len(prompt) - 1 + k
            token = gen.tokens.ids[0]
            assert abs(gen.tokens.logprobs[0] - ref[pos, token].item()) < 1e-4
            top = gen.top_tokens[0]
            values, ids = ref[pos].topk(len(top.ids))
            assert list(top.ids) == ids.tolist()
            assert max(abs(a - b) for a, b in zip(top.logprobs, values.tolist())) < 1e-4


def test_stop_sequence_and_eos(llama):
    """Stopping runs inside the step: a stop sequence taken from the greedy text ends it early."""
    model_dir, shard = llama
    p = prompts(model_dir, [10])[0]
    sim = new_sim(shard)
    sim.add(1, p, 20)
    sim.prefill([(1, 0)])
    sim.run_to_completion()
    full = sim.done[1]
    text = full.finished.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop
    sim = new_sim(shard)
    sim.add(2, p, 20, stop_sequences=(stop,))
    sim.prefill([(2, 0)])
    sim.run_to_completion()
    got = sim.done[2]
    assert got.finished.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert stop in got.finished.text and len(got.generated) < 20
    assert got.generated == full.generated[: len(got.generated)]
