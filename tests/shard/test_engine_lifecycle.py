"""Request lifecycle: recompute after preemption, no leak after 1,000 requests cycled through
(blocks freed by FilterBatch/ClearCache are reused), warmup budgets, fatal device errors."""

from __future__ import annotations

import random

import pytest
from reference import prompts
from shard_driver import RouterSim, engine_call
from test_engine_sampling import sampled
from tokenwire.shard.v1 import shard_pb2 as pb

from shard.distributed.groups import Dist
from shard.runner.warmup import WarmupSpec
from shard.errors import FailedPreconditionError, FatalDeviceError
from shard.server.loader import Shard, ShardConfig


@pytest.fixture(scope="module")
def mistral(tiny_models):
    model_dir = tiny_models["mistral"]
    shard = Shard(ShardConfig(model_id=str(model_dir), kv_cache_memory_mb=1), Dist())
    # A small pool (16 blocks of 16) so that 1,000 requests must reuse every block many times.
    shard.warmup(WarmupSpec(64, 128, 128, 8, max_batch_total_tokens=256))
    return model_dir, shard


def fresh(shard) -> RouterSim:
    shard.engine.clear_cache(None)
    return RouterSim(engine_call(shard), shard.runner.num_blocks, shard.runner.block_size)


@pytest.mark.parametrize("sampling", [None, sampled(3)], ids=["greedy", "seeded"])
def test_recompute_after_preemption_continues_the_same_text(mistral, sampling):
    model_dir, shard = mistral
    prompt = prompts(model_dir, [20])[0]
    sim = fresh(shard)
    sim.add(1, prompt, 24, sampling=sampling)
    sim.prefill([(1, 0)])
    sim.run_to_completion()
    full = sim.done[1]

    sim = fresh(shard)
    sim.add(1, prompt, 24, sampling=sampling)
    sim.prefill([(1, 0)])
    for _ in range(9):
        sim.decode()
    before = list(sim.requests[1].generated)
    assert len(before) == 10
    sim.filter([])  # preempted: the router frees its blocks
    assert shard.engine.requests == {}
    sim.add(2, prompt + before, 24, sampling=sampling, generated_len=10)
    sim.prefill([(2, 16), ])
    sim.prefill([(2, 0)])
    sim.run_to_completion()
    again = sim.done[2]
    assert before + again.generated == full.generated
    assert again.finished.generated_tokens == 24
    assert again.finished.text == full.finished.text


def test_no_leak_after_1000_requests(mistral):
    model_dir, shard = mistral
    sim = fresh(shard)
    pool = prompts(model_dir, [3, 9, 17, 26, 33])
    rng = random.Random(0)
    rid = 0
    wave = 0
    while rid < 1000:
        wave += 1
        ids = []
        for _ in range(4):
            rid += 1
            sim.add(rid, pool[rng.randrange(len(pool))], rng.randint(1, 4))
            ids.append(rid)
        sim.prefill([(i, 0) for i in ids[:2]])
        if sim.batch is not None:
            sim.decode()
        sim.prefill([(i, 0) for i in ids[2:]])
        if wave % 5 == 0 and sim.batch is not None:  # cancel one request mid-flight
            sim.filter(list(sim.batch.request_ids)[1:])
        if wave % 7 == 0 and sim.batch is not None:  # drop the whole batch
            sim.call("ClearCache", pb.ClearCacheRequest(id=sim.batch.id))
            for r in list(sim.batch.request_ids):
                sim.done[r] = sim.requests.pop(r)
                sim._release(sim.done[r])
            sim.batch = None
        sim.run_to_completion()
        assert not sim.requests
    assert len(sim.done) == 1000
    finished = [r for r in sim.done.values() if r.finished is not None]
    assert len(finished) > 800
    assert all(r.finished.generated_tokens == r.max_new_tokens == len(r.generated) for r in finished)
    assert shard.engine.requests == {} and shard.engine.batches == {}
    assert sorted(sim.free) == list(range(shard.runner.num_blocks))
    assert sim.blocks_ever_used == set(range(shard.runner.num_blocks))
    # Reused blocks hold no stale state: a request now generates what it does on a clean pool.
    sim.add(5000, pool[4], 8)
    sim.prefill([(5000, 0)])
    sim.run_to_completion()
    reused = sim.done[5000].generated
    clean = fresh(shard)
    clean.free.reverse()  # other blocks than above
    clean.add(1, pool[4], 8)
    clean.prefill([(1, 0)])
    clean.run_to_completion()
    assert clean.done[1].generated == reused


def test_warmup_budget_errors_name_the_flag(tiny_models):
    shard = Shard(ShardConfig(model_id=str(tiny_models["llama"]), kv_cache_memory_mb=0), Dist())
    with pytest.raises(FailedPreconditionError, match="--max-total-tokens"):
        shard.warmup(WarmupSpec(64, 128, 128, 4))
    with pytest.raises(FailedPreconditionError, match="--max-batch-prefill-tokens"):
        shard.warmup(WarmupSpec(64, 128, 32, 4))
    ok = Shard(ShardConfig(model_id=str(tiny_models["llama"]), kv_cache_memory_mb=1), Dist())
    result = ok.warmup(WarmupSpec(64, 128, 128, 4))
    # llama tiny: 2 layers * K,V * 16 slots * 2 heads * 16 dims * 4 bytes = 8 KiB per block
    assert ok.runner.kv_bytes_per_block() == 8192
    assert result.num_blocks == 2**20 // 8192 and result.max_supported_total_tokens == 128 * 16


def test_fatal_device_error_aborts_and_reports(mistral):
    model_dir, shard = mistral
    sim = fresh(shard)
    runner = shard.runner
    original = runner.execute

    def broken(step):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    runner.execute = broken
    try:
        sim.add(1, prompts(model_dir, [5])[0], 4)
        with pytest.raises(FatalDeviceError, match="illegal memory access"):
            sim.prefill([(1, 0)])
    finally:
        runner.execute = original
        shard.engine.clear_cache(None)


def test_special_tokens_are_excluded_from_the_finished_text(mistral, monkeypatch):
    """EOS/BOS keep their own token text, but GeneratedText.text is the generated text without
    special tokens (the proto contract; TGI does the same)."""
    model_dir, shard = mistral
    tokenizer = shard.engine.tokenizer
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    word = tokenizer.encode("fox", add_special_tokens=False).ids
    forced = iter(word + [bos] + word + [eos])
    from shard.engine import batches

    real_read = batches.read_host

    def scripted(*args, **kwargs):  # the sampled tokens as the host reads them
        out = real_read(*args, **kwargs)
        out.token_ids = [next(forced) for _ in out.token_ids]
        return out

    monkeypatch.setattr(batches, "read_host", scripted)
    sim = fresh(shard)
    sim.add(1, prompts(model_dir, [8])[0], 32, ignore_eos=False)
    sim.prefill([(1, 0)])
    sim.run_to_completion()
    done = sim.done[1]
    assert done.finished.finish_reason == pb.FINISH_REASON_EOS_TOKEN
    assert done.finished.text == "foxfox"
    texts = [t for gen in done.generations for t in gen.tokens.texts]
    assert "</s>" in texts and "<s>" in texts  # the special tokens' own texts are kept
