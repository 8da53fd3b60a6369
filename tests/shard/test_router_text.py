"""Text off the shard (issue 23, item 3): the router detokenizes and matches stop sequences for
ids-only requests (service.generation.text_stream), and what a client sees is exactly what the
shard's own text work gave: token texts, alternatives' and prompt tokens' texts, generated_text,
finish reasons, token counts and tokens per step; with overlap on and off and with speculation
(a stop sequence may match in the middle of a verified step). A request that a stop sequence
ends in the router is stopped in the engine and its KV blocks come back. The shard does no text
work for ids-only requests (its finish never touches the detokenizer)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from service.engine.contracts import (
    SamplingConfig,
    StepEvent,
    StoppingConfig,
    ValidatedRequest,
)
from service.engine.engine import LocalEngine
from service.generation.text_stream import RouterText
from shard.engine import batches
from shard.engine.contracts import BatchSpec, RequestSpec
from shard.engine.sampling import SamplingParams
from tests.helpers.shards import make_shard
from tests.helpers.spec_engine import PREEMPTING_BUDGETS, ShardServer, router_engine

pytestmark = pytest.mark.timeout(600)

VOCAB = 512


class CountingDetokenizer(batches.IncrementalDetokenizer):
    """The shard's detokenizer, counting its pushes (monkeypatched into shard.engine.batches)."""

    pushes = 0

    def push(self, token_id: int) -> str:
        CountingDetokenizer.pushes += 1
        return super().push(token_id)


@pytest.fixture(scope="module")
def model_dir(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    s = ShardServer(model_dir, tmp_path_factory.mktemp("router-text"), kv_cache_memory_mb=2)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def text(model_dir: Path) -> RouterText:
    return RouterText(Tokenizer.from_file(str(model_dir / "tokenizer.json")))


def _requests(stops: dict[int, tuple[str, ...]] | None = None) -> list[ValidatedRequest]:
    rng = random.Random(11)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]  # a common prefix: cache hits
    reqs = []
    for i in range(12):
        prompt = (shared[: rng.randint(17, 40)] + [rng.randrange(3, VOCAB)] if i % 4 == 0
                  else [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 50))])  # fmt: skip
        sampling = SamplingConfig()
        if i % 3 == 1:
            sampling = SamplingConfig(do_sample=True, temperature=0.9, top_k=40, seed=100 + i)
        reqs.append(ValidatedRequest(
            request_id=f"r{i}",
            input_ids=tuple(prompt),
            sampling=sampling,
            stopping=StoppingConfig(
                max_new_tokens=rng.randint(8, 48),
                stop_sequences=(stops or {}).get(i, ()),
                ignore_eos_token=i % 2 == 0,
            ),
            top_n_tokens=2 if i % 5 == 3 else 0,
            prefill_logprobs=i == 6,
        ))  # fmt: skip
    return reqs


async def _run(
    engine: LocalEngine, reqs: list[ValidatedRequest], text: RouterText | None
) -> list[list[StepEvent]]:
    """Every request's events, each one submitted a step after the previous one; with `text`
    ids-only and through the router's TextStream (as GenerationService runs them)."""

    async def one(i: int, r: ValidatedRequest) -> list[StepEvent]:
        target = engine.stats().steps + i
        while engine.stats().steps < target and engine.stats().running:
            await asyncio.sleep(0.001)
        inner = engine.submit(r if text is None else replace(r, ids_only=True))
        stream = inner if text is None else text.wrap(replace(r, ids_only=True), inner)
        events = []
        async for ev in stream:
            events.append(ev)
            if ev.finished is not None:
                # Finished for the client only once the engine let it go (a stopped request
                # too: its blocks are free then, not after it ran on to max_new_tokens).
                assert inner.seq_id not in engine.scheduler.seqs, r.request_id
                break
        return events

    return list(
        await asyncio.wait_for(asyncio.gather(*(one(i, r) for i, r in enumerate(reqs))), 600)
    )


def _view(events: list[StepEvent]) -> tuple:
    """What a client sees (log-probabilities aside: batches differ between runs)."""
    fin = events[-1].finished
    assert fin is not None
    return (
        tuple((e.token.id, e.token.text, e.token.special) for e in events),
        tuple(tuple((t.id, t.text, t.special) for t in e.top_tokens) for e in events),
        tuple((t.id, t.text) for e in events if e.prefill for t in e.prefill),
        fin.generated_text, fin.finish_reason, fin.generated_tokens, fin.seed,
        fin.tokens_per_step,
    )  # fmt: skip


def _spanning_stops(reference: list[list[StepEvent]]) -> dict[int, tuple[str, ...]]:
    """For every other request, a stop sequence made of the end of one token's text and the
    start of the next one's, around the middle of its reference output (it spans tokens)."""
    stops = {}
    for i, events in enumerate(reference):
        texts = [e.token.text for e in events if not e.token.special]
        k = len(texts) // 2
        if i % 2 or k < 2 or not texts[k - 1] or not texts[k]:
            continue
        stops[i] = (texts[k - 1][-2:] + texts[k][:2], "never-in-the-output-\u00e9")
    return stops


async def _idle(engine: LocalEngine) -> None:
    for _ in range(200):  # a stopped request's blocks come back at the next step boundary
        st = engine.stats()
        if st.running == 0 and st.kv_blocks_free == st.kv_blocks_total:
            return
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(("overlap", "speculate"), [(True, 0), (False, 0), (True, 3)])
async def test_router_text_equals_the_shards_text(
    server: ShardServer, text: RouterText, monkeypatch: pytest.MonkeyPatch, overlap: bool,
    speculate: int,
) -> None:  # fmt: skip
    monkeypatch.setattr(batches, "IncrementalDetokenizer", CountingDetokenizer)
    async with router_engine(server.url, PREEMPTING_BUDGETS, speculate, overlap=overlap) as engine:
        reference = await _run(engine, _requests(), None)
    stops = _spanning_stops(reference)
    assert len(stops) >= 4
    reqs = _requests(stops)
    views = {}
    for mode in ("shard", "router"):
        CountingDetokenizer.pushes = 0
        async with router_engine(
            server.url, PREEMPTING_BUDGETS, speculate, overlap=overlap
        ) as engine:
            events = await _run(engine, reqs, text if mode == "router" else None)
            await _idle(engine)
            st = engine.stats()
            # Every request's KV blocks came back, the stopped ones' too; none counts as aborted.
            assert engine.healthy and st.running == 0 and st.queued == 0
            assert st.kv_blocks_free == st.kv_blocks_total and st.aborted == 0
        views[mode] = [_view(ev) for ev in events]
        # The shard decoded text only when it was asked for it.
        assert (
            (CountingDetokenizer.pushes > 0)
            if mode == "shard"
            else (CountingDetokenizer.pushes == 0)
        )
    for i, (a, b) in enumerate(zip(views["shard"], views["router"], strict=True)):
        assert a == b, f"request {i} differs when the router makes the text"
    stopped = [i for i, v in enumerate(views["router"]) if v[4].value == "stop_sequence"]
    # The stop sequences ended their requests before max_new_tokens (tokens after the stop
    # never reached the client), and the others ran on.
    assert sorted(stopped) == sorted(stops)
    for i in stopped:
        assert views["router"][i][5] < reqs[i].stopping.max_new_tokens
        assert views["router"][i][3].endswith(stops[i][0])
    if speculate:
        assert any(len(v[7]) < v[5] for v in views["router"])  # some steps gave several tokens


def test_shard_finish_makes_no_text_for_ids_only_requests(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BatchState.finish of an ids-only request: no detokenizer, no decode, no stop check on
    text; the Generation carries ids, logprobs and specialness with empty texts."""
    shard = make_shard(model_dir)
    engine = shard.engine

    def no_text(*args: object, **kw: object) -> str:
        raise AssertionError("the shard decoded text for an ids-only request")

    monkeypatch.setattr(batches.IncrementalDetokenizer, "push", no_text)
    monkeypatch.setattr(engine, "_text", no_text)
    prompt = [5, 17, 33, 42, 8, 9]
    spec = RequestSpec(
        id=1, input_ids=prompt, cache_len=0, chunk_len=len(prompt), blocks=[0, 1],
        sampling=SamplingParams(), max_new_tokens=3, stop_sequences=["a", "e", " "],
        ignore_eos_token=True, prefill_logprobs=True, top_n_tokens=2, ids_only=True,
    )  # fmt: skip
    result = engine.finish(engine.launch_prefill(BatchSpec(1, [spec]), None, []))
    (gen,) = result.generations
    assert gen.tokens.texts == [""] and len(gen.tokens.ids) == 1
    assert gen.top_tokens[0].texts == ["", ""] and len(gen.top_tokens[0].ids) == 2
    assert gen.prefill_tokens is not None and set(gen.prefill_tokens.texts) == {""}
    assert engine.requests[1].detok is None
    ref = result.batch
    assert ref is not None
    for _ in range(2):  # stop sequences are the router's: only max_new_tokens ends it here
        result = engine.decode([ref], [])
        ref = result.batch or ref
    (gen,) = result.generations
    assert gen.finished is not None and gen.finished.finish_reason.value == "length"
    assert gen.finished.text == "" and gen.finished.generated_tokens == 3
    engine.clear_cache(None)


class _Inner:
    """An engine stream double: yields scripted events, records stop/cancel."""

    def __init__(self, events: list[StepEvent], error: Exception | None = None) -> None:
        self.events = list(events)
        self.error = error
        self.stopped = 0
        self.cancelled = 0

    def __aiter__(self) -> _Inner:
        return self

    async def __anext__(self) -> StepEvent:
        if self.events:
            return self.events.pop(0)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def stop(self) -> None:
        self.stopped += 1

    def cancel(self) -> None:
        self.cancelled += 1


def _ids(text: RouterText, words: str) -> list[int]:
    return text.tokenizer.encode(words, add_special_tokens=False).ids


def _request(stops: tuple[str, ...], ignore_eos: bool = False) -> ValidatedRequest:
    return ValidatedRequest(
        request_id="u", input_ids=(1, 5, 6), sampling=SamplingConfig(),
        stopping=StoppingConfig(max_new_tokens=50, stop_sequences=stops,
                                ignore_eos_token=ignore_eos),
        ids_only=True,
    )  # fmt: skip


async def _collect(stream) -> list[StepEvent]:
    return [ev async for ev in stream]


async def test_a_stop_in_the_middle_of_a_step_drops_the_rest_and_cuts_the_accounting(
    text: RouterText,
) -> None:
    from service.engine.contracts import Finished, FinishReason, TokenInfo
    from service.engine.engine import STOP_PLACEHOLDER

    ids = _ids(text, "the cat sat on the mat and ran")
    pieces = [text.tokenizer.decode(ids[: k + 1]) for k in range(len(ids))]
    k = next(k for k in range(1, len(ids)) if "sat" in pieces[k] and "sat" not in pieces[k - 1])
    events = [StepEvent(TokenInfo(t, "", -0.5)) for t in ids]  # ids only: no text
    accounting = Finished(
        "",
        len(ids),
        FinishReason.STOP_SEQUENCE,
        None,
        queue_seconds=0.25,
        inference_seconds=1.5,
        prefix_cache_hit_tokens=16,
        tokens_per_step=(1,) * (k - 1) + (3,) + (1,) * (len(ids) - k - 2),
    )
    inner = _Inner([*events, StepEvent(STOP_PLACEHOLDER, finished=accounting)])
    out = await _collect(text.wrap(_request(("sat",)), inner))
    assert inner.stopped == 1 and inner.cancelled == 0
    assert [e.token.id for e in out] == ids[: k + 1]  # tokens after the stop never show
    fin = out[-1].finished
    assert fin is not None and fin.finish_reason is FinishReason.STOP_SEQUENCE
    assert "".join(e.token.text for e in out) == fin.generated_text == pieces[k]
    assert fin.generated_tokens == k + 1
    assert fin.tokens_per_step == (1,) * (k - 1) + (2,)  # the 3-token step ends at the stop
    assert (fin.queue_seconds, fin.inference_seconds, fin.prefix_cache_hit_tokens) == (
        0.25,
        1.5,
        16,
    )


async def test_the_shards_finish_on_the_stop_token_keeps_the_shards_priority(
    text: RouterText,
) -> None:
    from service.engine.contracts import Finished, FinishReason, TokenInfo

    ids = _ids(text, "one two three")
    last = len(ids) - 1

    def script(reason: FinishReason) -> list[StepEvent]:
        fin = Finished("", len(ids), reason, None)
        return [StepEvent(TokenInfo(t, "", -0.5), finished=fin if i == last else None)
                for i, t in enumerate(ids)]  # fmt: skip

    stop = ("three",)
    # max_new_tokens reached on the stop's token: the stop sequence wins (no engine stop).
    inner = _Inner(script(FinishReason.LENGTH))
    out = await _collect(text.wrap(_request(stop), inner))
    assert out[-1].finished.finish_reason is FinishReason.STOP_SEQUENCE and inner.stopped == 0
    # EOS on the stop's token: the model's own end wins, unless EOS is ignored (a grammar).
    inner = _Inner(script(FinishReason.EOS_TOKEN))
    out = await _collect(text.wrap(_request(stop), inner))
    assert out[-1].finished.finish_reason is FinishReason.EOS_TOKEN
    out = await _collect(text.wrap(_request(stop, ignore_eos=True), _Inner(script(
        FinishReason.EOS_TOKEN))))  # fmt: skip
    assert out[-1].finished.finish_reason is FinishReason.STOP_SEQUENCE
    assert out[-1].finished.generated_text == text.tokenizer.decode(ids)


async def test_a_failure_after_the_stop_still_finishes_the_request(text: RouterText) -> None:
    from service.engine.contracts import DeadlineExceededError, FinishReason, TokenInfo

    ids = _ids(text, "red green blue")
    inner = _Inner([StepEvent(TokenInfo(t, "", -0.5)) for t in ids],
                   DeadlineExceededError("late"))  # fmt: skip
    out = await _collect(text.wrap(_request(("green",)), inner))
    fin = out[-1].finished
    assert fin is not None and fin.finish_reason is FinishReason.STOP_SEQUENCE
    assert fin.generated_text.endswith("green") and inner.stopped == 1
