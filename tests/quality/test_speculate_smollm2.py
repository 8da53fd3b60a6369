"""Speculative decoding on trained weights: SmolLM2-135M-Instruct (the embedded default) on
input-grounded chat prompts (summarize / rewrite a given paragraph, edit given code), served by a
real shard over real gRPC to the router's engine: greedy tokens with --speculate 4 equal those
with --speculate 0, batched, with chunked prefill, and drafts are really accepted."""

from __future__ import annotations

import pytest

from benchmarks.speculate import GROUNDED_TASKS, chat_prompt_ids
from service.engine.backend import WarmupBudgets
from tests.helpers.spec_engine import Req, ShardServer, router_engine, run_all, token_ids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NEW_TOKENS = 40
BUDGETS = WarmupBudgets(
    max_input_tokens=256, max_total_tokens=320, max_batch_prefill_tokens=256, max_batch_size=8
)


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    s = ShardServer(smollm2_dir, tmp_path_factory.mktemp("spec-smollm2"), kv_cache_memory_mb=64)
    yield s
    s.stop()


async def test_greedy_equal_with_speculation_on_grounded_prompts(server, smollm2_dir) -> None:
    prompts = [chat_prompt_ids(smollm2_dir, task) for task in GROUNDED_TASKS[:3]]
    reqs = [Req(p, max_new_tokens=NEW_TOKENS, ignore_eos=False) for p in prompts]
    results = {}
    for speculate in (0, 4):
        # Prefill budget 64: the ~150-token prompts prefill in chunks next to decoding requests.
        async with router_engine(
            server.url, BUDGETS, speculate, max_batch_prefill_tokens=64
        ) as engine:
            results[speculate] = await run_all(engine, reqs, stagger_steps=1)
            stats = engine.stats()
    for ref, spec in zip(results[0], results[4], strict=True):
        assert token_ids(spec) == token_ids(ref)
        assert spec[-1].finished.generated_text == ref[-1].finished.generated_text
    assert stats.spec_accepted_tokens > 0
    generated = sum(len(e) for e in results[4])
    print(f"speculate 4: {stats.spec_accepted_tokens}/{stats.spec_proposed_tokens} drafts "
          f"accepted; {generated} tokens in {stats.steps} steps")
