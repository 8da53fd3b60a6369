"""Overlapped steps (the router's --overlap, issue 23): the router schedules and sends step N+1
before it reads step N's answer, and the shard launches step N+1 (its inputs: step N's sampled
ids, still on the device) before it finishes step N. Outputs must be exactly those of one step
at a time: greedy and seeded sampling, stop sequences, top-n tokens, penalties (their rows wait
for the previous step), preemption, prefix-cache hits and cancellation; both through the real
gRPC protocol (a shard served from a thread, LocalEngine + ShardClient) and through the
in-process engine-only driver of the benchmark (benchmarks/harness/engine_bound.py)."""

from __future__ import annotations

import asyncio
import random

import pytest

from benchmarks.harness.engine_bound import EngineBoundConfig, WorkRequest, drive
from service.engine.contracts import SamplingConfig, StepEvent
from shard.engine.sampling import SamplingParams
from tests.helpers.shards import make_shard
from tests.helpers.spec_engine import (
    PREEMPTING_BUDGETS,
    Req,
    ShardServer,
    router_engine,
    run_all,
    validated,
)

pytestmark = pytest.mark.timeout(600)

VOCAB = 512


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    s = ShardServer(tiny_models["llama"], tmp_path_factory.mktemp("overlap"), kv_cache_memory_mb=2)
    yield s
    s.stop()


def _requests() -> list[Req]:
    rng = random.Random(7)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]  # a common prefix: cache hits
    reqs = []
    for i in range(14):
        n = rng.randint(4, 60)
        prompt = (
            shared[: rng.randint(17, 40)] + [rng.randrange(3, VOCAB)]
            if i % 4 == 0
            else [rng.randrange(3, VOCAB) for _ in range(n)]
        )
        sampling = SamplingConfig()
        if i % 3 == 1:
            sampling = SamplingConfig(do_sample=True, temperature=0.9, top_k=40, seed=100 + i)
        if i == 5:  # its rows need the previous token on the host: no overlap for them
            sampling = SamplingConfig(repetition_penalty=1.3, frequency_penalty=0.2)
        stop = ("e",) if i % 5 == 2 else ()
        reqs.append(
            Req(
                prompt,
                max_new_tokens=rng.randint(1, 50),
                sampling=sampling,
                stop=stop,
                top_n=2 if i % 6 == 3 else 0,
                ignore_eos=i % 2 == 0,
            )
        )
    return reqs


def _view(events: list[StepEvent]) -> tuple:
    """What a client sees: tokens (id, text), alternatives, the final text and reason (the
    log-probabilities are compared by _same_logprobs)."""
    toks = tuple((e.token.id, e.token.text) for e in events)
    tops = tuple(tuple(t.id for t in e.top_tokens) for e in events)
    fin = events[-1].finished
    assert fin is not None
    return toks, tops, fin.generated_text, fin.finish_reason, fin.generated_tokens


def _logprobs(events: list[StepEvent]) -> list[float]:
    return [e.token.logprob for e in events]


def _same_logprobs(a: list[float], b: list[float]) -> bool:
    """Equal up to float rounding: a row's logits may be computed in a batch of another size."""
    return len(a) == len(b) and all(abs(x - y) <= 1e-4 for x, y in zip(a, b))


async def test_served_outputs_equal_with_and_without_overlap(server) -> None:
    reqs = _requests()
    views, stats, lps, overlapped, chunk_overlaps = {}, {}, {}, {}, {}
    engine_state = server.shard.engine
    # (router overlap, shard overlaps steps with prompt chunks): the second is CUDA's policy
    # (BatchState.overlap_eager_steps): a chunk step settles the step before it, whose result
    # the servicer hands to its RPC as soon as that launch sets it.
    modes = [(False, True), (True, True), (True, False)]
    for mode in modes:
        before = engine_state.overlapped_steps
        chunks_before = engine_state.overlapped_chunk_steps
        engine_state.overlap_eager_steps = mode[1]
        try:
            async with router_engine(server.url, PREEMPTING_BUDGETS, 0, overlap=mode[0]) as engine:
                events = await run_all(engine, reqs, stagger_steps=1)
                stats[mode] = engine.stats()
                assert engine.healthy and stats[mode].running == 0
                assert stats[mode].kv_blocks_free == stats[mode].kv_blocks_total
        finally:
            engine_state.overlap_eager_steps = True
        views[mode] = [_view(ev) for ev in events]
        lps[mode] = [_logprobs(ev) for ev in events]
        overlapped[mode] = engine_state.overlapped_steps - before
        chunk_overlaps[mode] = engine_state.overlapped_chunk_steps - chunks_before
    # The shard launched steps while the previous one was unfinished only with overlap, and
    # no step with chunks when those settle the one before (decode steps still overlap).
    assert overlapped[modes[0]] == 0 and overlapped[modes[1]] > 10
    assert overlapped[modes[2]] > 10 and chunk_overlaps[modes[2]] == 0
    for mode in modes[1:]:
        for i, (a, b) in enumerate(zip(views[modes[0]], views[mode])):
            assert a == b, f"request {i} differs with overlap {mode}"
            assert _same_logprobs(lps[modes[0]][i], lps[mode][i]), f"request {i} logprobs, {mode}"
    for s in stats.values():
        assert s.preemptions > 0 and s.prefix_cache_hit_tokens > 0
    reasons = {v[3].value for v in views[modes[1]]}
    assert "stop_sequence" in reasons and "length" in reasons


async def test_cancel_while_overlapping_leaves_the_rest_exact(server) -> None:
    reqs = [Req([(11 * j + i) % VOCAB for j in range(20)], max_new_tokens=40) for i in range(6)]
    async with router_engine(server.url, PREEMPTING_BUDGETS, 0, overlap=False) as engine:
        reference = [_view(ev) for ev in await run_all(engine, reqs)]
    async with router_engine(server.url, PREEMPTING_BUDGETS, 0, overlap=True) as engine:
        victim = engine.submit(validated(Req([5, 6, 7, 8], max_new_tokens=150), 99))
        streams = [engine.submit(validated(r, i)) for i, r in enumerate(reqs)]
        got = 0
        async for _ in victim:
            got += 1
            if got == 5:
                victim.cancel()
                break
        views = [_view([ev async for ev in s]) for s in streams]
        for _ in range(100):  # the cancelled request's blocks come back at a step boundary
            if engine.stats().kv_blocks_free == engine.stats().kv_blocks_total:
                break
            await asyncio.sleep(0.01)
        stats = engine.stats()
        assert engine.healthy and stats.running == 0 and stats.queued == 0
        assert stats.kv_blocks_free == stats.kv_blocks_total
    assert views == reference


def test_engine_only_driver_is_exact_with_overlap(tiny_models) -> None:
    """The benchmark's in-process loop (scheduler + shard, no gRPC), overlap off and on."""
    shard = make_shard(tiny_models["llama"])
    engine = shard.engine
    rng = random.Random(3)
    shared = [rng.randrange(3, VOCAB) for _ in range(48)]
    workload = []
    for i in range(24):
        prompt = (
            shared[: rng.randint(20, 48)]
            if i % 3 == 0
            else [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 70))]
        )
        sampling = (
            SamplingParams(do_sample=True, temperature=0.8, top_k=30, seed=i)
            if i % 2
            else SamplingParams()
        )
        workload.append(
            WorkRequest(
                prompt,
                rng.randint(1, 60),
                sampling,
                stop_sequences=("a",) if i % 7 == 3 else (),
                ignore_eos_token=i % 4 != 1,
            )
        )
    cfg = EngineBoundConfig(max_batch_prefill_tokens=64, max_batch_size=8)
    num_blocks = 20  # 320 tokens for 8 running requests: preemption
    off = drive(engine, workload, cfg, num_blocks, shard.runner.block_size, overlap=False)
    on = drive(engine, workload, cfg, num_blocks, shard.runner.block_size, overlap=True)
    assert on.tokens == off.tokens and on.finish == off.finish
    assert len(on.finish) == len(workload)
    assert off.overlapped_steps == 0 and on.overlapped_steps > on.steps // 2
    assert on.preemptions > 0 and on.prefix_hit_tokens > 0
    s = on.summary()
    assert s["requests_per_s"] > 0 and 0 < s["gpu_seconds"] <= s["wall_seconds"]
    assert s["output_tokens"] == sum(len(t) for t in on.tokens.values())


def test_packed_generations_read_as_the_per_request_messages() -> None:
    """Item 3: a step's plain generations travel as one PackedTokens; the router's StepOutput
    is the same as from one Generation message per request."""
    from service.shard_client import convert as router_convert
    from shard.engine.contracts import (
        CachedBatchRef,
        FinishedText,
        Generation,
        StepResult,
        StepTimings,
        TokenList,
    )
    from shard.engine.stopping import StopReason
    from shard.server import convert as shard_convert

    def tl(ids: list[int]) -> TokenList:
        return TokenList(
            ids,
            [-0.25 * (i + 1) for i in range(len(ids))],
            [f"w{i}" for i in ids],
            [i == 2 for i in ids],
        )

    gens = [Generation(i, tl([10 + i])) for i in range(1, 40)]
    gens += [
        Generation(50, tl([2]), finished=FinishedText("w2", 7, StopReason.EOS_TOKEN, None)),
        Generation(51, tl([5]), top_tokens=[tl([5, 6])]),
        Generation(52, tl([7]), prefill_tokens=tl([1, 2, 3])),
        Generation(53, tl([8, 9, 4])),  # accepted drafts
    ]
    result = StepResult(
        gens, CachedBatchRef(3, list(range(1, 40)) + [51, 52, 53]), StepTimings(1, 2, 3, 6)
    )
    for to_proto in (shard_convert.decode_to_proto, shard_convert.prefill_to_proto):
        plain = router_convert.step_output(to_proto(result))
        msg = to_proto(result, True)
        assert len(msg.packed.request_ids) == 39 and len(msg.generations) == 4
        packed = router_convert.step_output(type(msg).FromString(msg.SerializeToString()))
        by_id = {g.seq_id: g for g in plain.generations}
        assert {g.seq_id: g for g in packed.generations} == by_id
        assert (packed.batch_id, packed.batch_request_ids) == (
            plain.batch_id,
            plain.batch_request_ids,
        )


def test_benchmark_engine_part_runs_on_cpu(tmp_path) -> None:
    """`--parts engine` end to end on a tiny model: both runs, the same outputs, the bounds."""
    import argparse

    from benchmarks.harness.engine_part import bench_engine
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model

    model_dir = make_tiny_model(
        tmp_path / "llama", TinyModelSpec("llama", max_position_embeddings=4096)
    )
    args = argparse.Namespace(
        quantize=None,
        kv_cache_dtype="auto",
        e2e_max_batch_size=8,
        requests=8,
        engine_profile_start=5,
        engine_profile_stop=20,
        engine_trace_dir=None,
        engine_trace_steps=(0, 0),
    )
    out = bench_engine(model_dir, args, device="cpu")
    assert out["outputs_equal"] and out["requests_with_equal_outputs"] == 8
    off, on = out["runs"]["off"], out["runs"]["on"]
    assert off["overlapped_steps"] == 0 and on["overlapped_steps"] > on["steps"] // 2
    for r in (off, on):
        assert r["requests"] == 8 and r["output_tokens"] > 0
        assert 0 < r["gpu_seconds"] <= r["wall_seconds"] and r["mean_gpu_step_ms"] > 0
