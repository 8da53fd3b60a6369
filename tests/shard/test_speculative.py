"""Speculative decoding end to end over the internal protocol: the router's engine (scheduler,
n-gram proposer, ShardClient) drives a real shard over real gRPC, once with --speculate 4 and
once with 0, and every request must come out token for token the same (greedy and seeded
sampling), through mixed batches, chunked prefill, preemption and prefix-cache hits, with stop
sequences, logprobs and top-n tokens; and the verification rule is the speculative rejection
rule (a chi-square test over many seeds)."""

from __future__ import annotations

import math

import pytest
import torch
from prometheus_client import generate_latest

from service.engine.backend import WarmupBudgets
from service.engine.contracts import SamplingConfig
from service.engine.engine import LocalEngine
from service.observability.metrics import ServerMetrics
from shard.engine.sampling import Sampler, SamplingParams
from tests.helpers.spec_engine import Req, ShardServer, router_engine, run_all, token_ids

pytestmark = pytest.mark.timeout(600)

BUDGETS = WarmupBudgets(
    max_input_tokens=64, max_total_tokens=160, max_batch_prefill_tokens=64, max_batch_size=16
)
VOCAB = 512


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    s = ShardServer(tiny_models["llama"], tmp_path_factory.mktemp("spec"), kv_cache_memory_mb=2)
    yield s
    s.stop()


def _prompts() -> list[list[int]]:
    text = [(37 * j + 5) % VOCAB for j in range(40)]
    return [
        [11, 12, 13, 14, 15] * 6,  # loops: drafts from the prompt
        text,  # nothing repeats in the prompt: drafts only once the output repeats
        text[:24] + [99] + text[:6],  # "copies" a passage it has seen
        [7, 8],
        [(13 * j + 1) % VOCAB for j in range(33)],
        [3, 4, 5] * 9 + [6],
    ]


async def _both(server: ShardServer, reqs: list[Req], stagger: int = 0, **engine_kw):
    """Events of every request with --speculate 0, then with 4, and the speculative engine."""
    out = []
    for speculate in (0, 4):
        async with router_engine(server.url, BUDGETS, speculate, **engine_kw) as engine:
            out.append(await run_all(engine, reqs, stagger))
            _check_idle(engine)
            stats = engine.stats()
    return out[0], out[1], stats


def _check_idle(engine: LocalEngine) -> None:
    st = engine.stats()
    assert st.running == 0 and st.queued == 0 and st.kv_blocks_free == st.kv_blocks_total


async def test_greedy_equal_in_mixed_batches_with_chunked_prefill(server) -> None:
    reqs = [Req(p, max_new_tokens=20 + 7 * (i % 3)) for i, p in enumerate(_prompts())]
    # Budget 16: prompts over 16 tokens prefill in chunks beside decoding requests; requests
    # join the running batch two steps apart.
    ref, spec, stats = await _both(server, reqs, stagger=2, max_batch_prefill_tokens=16)
    for r, a, b in zip(reqs, ref, spec, strict=True):
        assert token_ids(b) == token_ids(a)
        assert len(b) == r.max_new_tokens
        assert [e.token.text for e in b] == [e.token.text for e in a]
        fin = b[-1].finished
        assert fin.generated_text == a[-1].finished.generated_text
        # Details: tokens per step add up, and some steps gave several tokens.
        assert sum(fin.tokens_per_step) == r.max_new_tokens
    assert a[-1].finished.tokens_per_step == ()  # the reference engine does not speculate
    assert stats.spec_proposed_tokens > 0 and stats.spec_accepted_tokens > 0
    assert stats.steps < sum(r.max_new_tokens for r in reqs)  # fewer steps than tokens overall
    assert max(max(s[-1].finished.tokens_per_step) for s in spec) > 1


async def test_greedy_equal_under_preemption_and_with_prefix_hits(server) -> None:
    shared = [(17 * j + 3) % VOCAB for j in range(32)]
    reqs = [Req(shared + [100 + i, 101, 100 + i, 101], max_new_tokens=40) for i in range(6)]
    # 12 blocks of 16 tokens for 6 requests of up to 76 tokens: the youngest are preempted and
    # recomputed (from the shared prefix blocks in the prefix cache).
    ref, spec, stats = await _both(server, reqs, num_blocks=12)
    for a, b in zip(ref, spec, strict=True):
        assert token_ids(b) == token_ids(a)
    assert stats.preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert stats.spec_accepted_tokens > 0


async def test_stop_sequences_logprobs_and_top_tokens_see_only_accepted_tokens(server) -> None:
    prompts = _prompts()
    probe = [Req(p, max_new_tokens=30, top_n=3) for p in prompts[:3]]
    ref, _, _ = await _both(server, probe[:1])
    stop = ref[0][9].token.text  # text of the 10th token: a stop sequence that will match
    reqs = [Req(p, max_new_tokens=30, top_n=3, stop=(stop,)) for p in prompts[:3]]
    ref, spec, stats = await _both(server, reqs)
    assert ref[0][-1].finished.finish_reason.value == "stop_sequence"
    for a, b in zip(ref, spec, strict=True):
        assert token_ids(b) == token_ids(a)
        assert b[-1].finished.finish_reason == a[-1].finished.finish_reason
        assert b[-1].finished.generated_text == a[-1].finished.generated_text
        for ea, eb in zip(a, b, strict=True):
            assert math.isclose(eb.token.logprob, ea.token.logprob, abs_tol=1e-4)
            assert [t.id for t in eb.top_tokens] == [t.id for t in ea.top_tokens]
            assert len(eb.top_tokens) == 3
    assert stats.spec_accepted_tokens > 0


async def test_seeded_sampling_is_reproducible_with_speculation(server) -> None:
    loop = _prompts()[0]
    reqs = [
        Req(loop, max_new_tokens=16, sampling=SamplingConfig(
            do_sample=True, temperature=0.7, top_k=4, seed=seed
        ))
        for seed in range(16)
    ]  # fmt: skip
    ref, spec, stats = await _both(server, reqs)
    for a, b in zip(ref, spec, strict=True):
        assert token_ids(b) == token_ids(a)
        assert b[-1].finished.seed == a[-1].finished.seed
    assert stats.spec_accepted_tokens > 0
    assert len({tuple(token_ids(b)) for b in spec}) > 1  # really sampled


async def test_speculation_metrics(server) -> None:
    async with router_engine(server.url, BUDGETS, 4) as engine:
        await run_all(engine, [Req(_prompts()[0], max_new_tokens=12)])
        metrics = ServerMetrics(stats=engine.stats)
        text = generate_latest(metrics.registry).decode()
    st = engine.stats()
    assert f"tokenwire_speculative_proposed_tokens_total {float(st.spec_proposed_tokens)}" in text
    assert f"tokenwire_speculative_accepted_tokens_total {float(st.spec_accepted_tokens)}" in text
    steps = sum(st.spec_step_tokens)
    assert steps > 0
    assert f'tokenwire_speculative_accepted_tokens_per_step_bucket{{le="+Inf"}} {float(steps)}' in text
    assert 'tokenwire_speculative_accepted_tokens_per_step_bucket{le="5.0"}' in text


async def test_steps_above_the_adaptive_limit_are_plain_decode_steps(server) -> None:
    """With more running requests than --speculate-max-batch-size the router drafts nothing, and
    the shard gets exactly the steps of --speculate 0: one token per row and logits rows
    0..n-1 (the runner's condition for replaying its plain decode CUDA graph); outputs equal."""
    prompts = [[11, 12, 13, 14, 15] * 4, [3, 4, 5] * 6 + [6, 7], [7, 8] * 10]  # 60 tokens: 1 step
    reqs = [Req(p, max_new_tokens=10) for p in prompts]
    runner = server.shard.runner
    steps: dict[int, list[tuple[list[int], list[int]]]] = {0: [], 4: []}
    execute = runner.execute
    try:
        for speculate in (0, 4):
            def record(step, seen=steps[speculate]):
                seen.append((list(step.query_lens), list(step.logits_indices)))
                return execute(step)

            runner.execute = record
            async with router_engine(server.url, BUDGETS, speculate,
                                     speculate_max_batch_size=2) as engine:
                events = await run_all(engine, reqs)
                if speculate == 0:
                    ref = events
            st = engine.stats()
    finally:
        del runner.execute  # back to the class's method
    assert [token_ids(e) for e in events] == [token_ids(e) for e in ref]
    assert st.spec_proposed_tokens == 0
    assert steps[4] == steps[0]
    decodes = steps[4][1:]  # after the one prefill step
    assert len(decodes) == 9
    assert all(q == [1, 1, 1] and rows == [0, 1, 2] for q, rows in decodes)
    assert [e[-1].finished.tokens_per_step for e in events] == [(1,) * 10] * 3


def test_tokens_per_step_rebuilt_from_the_multi_token_steps() -> None:
    from service.engine.engine import _tokens_per_step

    assert _tokens_per_step(None, 5) == ()
    assert _tokens_per_step([], 3) == (1, 1, 1)
    # 2 single steps, a step of 3 (tokens 2..4), one single, a step of 2 that ends it.
    assert _tokens_per_step([(2, 3), (6, 2)], 8) == (1, 1, 3, 1, 2)
    assert _tokens_per_step([(0, 4)], 4) == (4,)


def test_verification_is_the_speculative_rejection_rule() -> None:
    """Draft x, model distribution p: accepting x iff the position's seeded sample equals x
    accepts with probability p(x) and, on rejection, emits p without x renormalised; the
    emitted token is distributed as p (chi-square over 6,000 seeds, p < 0.001 critical value)."""
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    draft = 1
    n = 6000
    logits = p.log().repeat(n, 1)  # [n, 6]
    params = [SamplingParams(do_sample=True, seed=seed) for seed in range(n)]
    out = Sampler(torch.device("cpu")).sample(
        logits, params, [[0]] * n, [5] * n, [0] * n
    ).token_ids
    counts = torch.bincount(torch.tensor(out), minlength=6).double()
    expected = p.double() * n
    assert float(((counts - expected) ** 2 / expected).sum()) < 20.52  # df 5
    accepted = counts[draft] / n
    sd = math.sqrt(p[draft] * (1 - p[draft]) / n)
    assert abs(float(accepted) - float(p[draft])) < 4 * sd
    rejected = counts.clone()
    rejected[draft] = 0
    residual = p.double().clone()
    residual[draft] = 0
    residual /= residual.sum()
    r_expected = residual * rejected.sum()
    keep = residual > 0
    chi2 = float(((rejected[keep] - r_expected[keep]) ** 2 / r_expected[keep]).sum())
    assert chi2 < 18.47  # df 4


async def test_public_api_reports_tokens_per_step(server, tiny_models) -> None:
    """Generate and GenerateStream through the public servicer in front of a speculating
    engine: every token is streamed, details carry the tokens of each step."""
    from tokenwire.v1 import generate_pb2 as pb

    from tests.helpers.router_harness import running_router

    params = pb.GenerateParameters(max_new_tokens=24, details=True)
    inputs = "a b c a b c a b c a b c"
    async with router_engine(server.url, BUDGETS, 4) as engine:
        async with running_router(engine, tiny_models["llama"]) as router:
            reply = await router.stub.Generate(pb.GenerateRequest(inputs=inputs, parameters=params))
            events = [e async for e in router.stub.GenerateStream(
                pb.GenerateRequest(inputs=inputs, parameters=params))]  # fmt: skip
    d = reply.details
    assert len(d.accepted_tokens_per_step) > 0
    assert sum(d.accepted_tokens_per_step) == d.generated_tokens == len(d.tokens)
    assert [e.token.id for e in events] == [t.id for t in d.tokens]
    assert [e.index for e in events] == list(range(len(events)))
    assert list(events[-1].details.accepted_tokens_per_step) == list(d.accepted_tokens_per_step)


async def test_cancel_while_speculating_frees_everything(server) -> None:
    from tests.helpers.spec_engine import validated

    async with router_engine(server.url, BUDGETS, 4) as engine:
        stream = engine.submit(validated(Req(_prompts()[0], max_new_tokens=60), 0))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 10:
                stream.cancel()
                break
        other = await run_all(engine, [Req(_prompts()[5], max_new_tokens=12)])
        assert len(other[0]) == 12
        _check_idle(engine)
        assert server.shard.engine.requests == {}
