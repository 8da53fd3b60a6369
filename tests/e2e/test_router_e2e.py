"""End to end: a REAL `tokenwire router` in front of a REAL `tokenwire shard`, both as processes on
loopback, serving the tiny random-weight llama on CPU (the acceptance of issue 4).

Three deployments: `main` (concurrency, streams vs unary, validation, cancellation, prefix cache),
`small_kv` (a KV cache of ~4 sequences and --max-concurrent-requests 16: preemption and
admission), and `doomed` (its shard is killed with SIGKILL).
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from tokenizers import Tokenizer
from tokenwire.v1 import generate_pb2 as pb
from tokenwire.v1 import generate_pb2_grpc

from tests.helpers.metrics import scrape
from tests.helpers.processes import Deployment, health_status, start_deployment
from tests.helpers.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "router",
    "batches",
    "requests",
    "paged",
    "attention",
    "keeps",
    "keys",
    "values",
    "blocks",
    "tokens",
    "stream",
    "latency",
    "model",
    "answered",
    "question",
    "care",
    "testing",
    "generate",
]


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def main(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = start_deployment(
        tiny_model_dir,
        tmp_path_factory.mktemp("main"),
        router_args=[
            "--max-input-tokens", "400",
            "--max-total-tokens", "512",
            "--max-batch-prefill-tokens", "512",
            "--max-batch-size", "64",
            "--max-concurrent-requests", "96",
        ],
    )  # fmt: skip
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def small_kv(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    # 28 blocks of 16 tokens: ~4 sequences of 110 tokens.
    deployment = start_deployment(
        tiny_model_dir,
        tmp_path_factory.mktemp("small_kv"),
        router_args=[
            "--max-input-tokens", "128",
            "--max-total-tokens", "256",
            "--max-batch-prefill-tokens", "256",
            "--max-batch-size", "32",
            "--max-batch-total-tokens", "448",
            "--max-concurrent-requests", "16",
        ],
    )  # fmt: skip
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def stub(channel: grpc.aio.Channel) -> generate_pb2_grpc.TextGenerationStub:
    return generate_pb2_grpc.TextGenerationStub(channel)


async def solo(deployment: Deployment, requests: list[pb.GenerateRequest]) -> list[str]:
    """generated_text of each request run alone (one at a time)."""
    async with grpc.aio.insecure_channel(deployment.target) as channel:
        return [(await stub(channel).Generate(r, timeout=60)).generated_text for r in requests]


async def stream_text(call) -> tuple[str, str, list[pb.GenerateStreamResponse]]:  # type: ignore[no-untyped-def]
    """(concatenated non-special token texts, final generated_text, events) of a stream."""
    events = await read_all(call)
    text = "".join(e.token.text for e in events if not e.token.special)
    return text, events[-1].generated_text, events


async def read_all(call, first: list | None = None) -> list[pb.GenerateStreamResponse]:  # type: ignore[no-untyped-def]
    """Every remaining event of a stream, with read() (a call read once cannot be iterated)."""
    events = list(first or [])
    while (event := await call.read()) is not grpc.aio.EOF:
        events.append(event)
    return events


# --- main deployment ------------------------------------------------------------------------


def mixed_requests(n: int, seed: int = 0) -> list[pb.GenerateRequest]:
    """Greedy and seeded-sampling requests with mixed lengths, stops, penalties and top-n."""
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        params = pb.GenerateParameters(max_new_tokens=rng.randint(4, 24), details=True)
        kind = i % 4
        if kind == 1:
            params.repetition_penalty = 1.3
            params.top_n_tokens = 2
        elif kind == 2:
            params.do_sample = True
            params.seed = 1000 + i
            params.temperature = 0.8
            params.top_k = 20
        elif kind == 3:
            params.stop.append("s")
            params.frequency_penalty = 0.5
        requests.append(
            pb.GenerateRequest(inputs=prompt(rng, rng.randint(2, 40)), parameters=params)
        )
    return requests


async def test_health_serving_and_info(main: Deployment) -> None:
    assert health_status(main.target) == health_pb2.HealthCheckResponse.SERVING
    async with grpc.aio.insecure_channel(main.target) as channel:
        info = await stub(channel).Info(pb.InfoRequest())
        await stub(channel).Health(pb.HealthRequest())
    assert (info.max_input_tokens, info.max_total_tokens) == (400, 512)
    assert info.model_device_type == "cpu" and info.num_shard == 1 and info.num_kv_blocks > 0


async def test_64_concurrent_mixed_streams_equal_solo_runs_and_unary(main: Deployment) -> None:
    requests = mixed_requests(64)
    expected = await solo(main, requests)
    async with grpc.aio.insecure_channel(main.target) as channel:
        results = await asyncio.gather(
            *(stream_text(stub(channel).GenerateStream(r, timeout=120)) for r in requests)
        )
    for request, want, (concatenated, final, events) in zip(requests, expected, results):
        assert final == want, request
        assert concatenated == want, request
        assert [e.index for e in events] == list(range(len(events)))
        assert events[-1].details.generated_tokens == len(events)
        if request.parameters.top_n_tokens:
            assert all(len(e.top_tokens) == 2 for e in events)


async def test_invalid_inputs_are_invalid_argument(main: Deployment) -> None:
    cases = [
        ("inputs", pb.GenerateRequest(inputs="")),
        ("parameters.temperature", pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(temperature=-1))),
        ("parameters.top_p", pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(top_p=1.5))),
        ("parameters.max_new_tokens", pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(max_new_tokens=600))),
        ("inputs", pb.GenerateRequest(inputs="fox " * 500)),
        ("parameters.best_of", pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(best_of=2))),
        ("parameters.stop", pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(stop=list("abcde")))),
    ]  # fmt: skip
    async with grpc.aio.insecure_channel(main.target) as channel:
        for field, request in cases:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub(channel).Generate(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(field), err.value.details()


async def test_best_of_returns_the_other_sequences(main: Deployment) -> None:
    request = pb.GenerateRequest(
        inputs="the quick brown fox",
        parameters=pb.GenerateParameters(
            max_new_tokens=8, best_of=2, do_sample=True, seed=5, details=True
        ),
    )
    async with grpc.aio.insecure_channel(main.target) as channel:
        response = await stub(channel).Generate(request)
    d = response.details
    assert len(d.best_of_sequences) == 1
    assert {d.seed, d.best_of_sequences[0].seed} == {5, 6}
    assert sum(t.logprob for t in d.tokens) >= sum(t.logprob for t in d.best_of_sequences[0].tokens)


async def test_cancel_half_of_32_streams_frees_every_kv_block(main: Deployment) -> None:
    # The cancelled half asks for 10x the tokens of the survivors: only a working cancel frees
    # their blocks (and stops the engine stepping them) by the time the survivors are done.
    rng = random.Random(7)
    requests = [
        pb.GenerateRequest(
            inputs=prompt(rng, rng.randint(5, 30)),
            parameters=pb.GenerateParameters(max_new_tokens=400 if i % 2 == 0 else 40),
        )
        for i in range(32)
    ]
    keep = requests[1::2]
    before = scrape(main.metrics_port)
    async with grpc.aio.insecure_channel(main.target) as channel:
        calls = [stub(channel).GenerateStream(r, timeout=120) for r in requests]
        firsts = [await call.read() for call in calls]  # everyone is generating
        for call in calls[0::2]:
            call.cancel()
        survivors = await asyncio.gather(
            *(read_all(c, [f]) for c, f in zip(calls[1::2], firsts[1::2]))
        )
    await until(
        lambda: (
            (m := scrape(main.metrics_port))["tokenwire_kv_blocks_free"]
            == m["tokenwire_kv_blocks_total"]
            and m["tokenwire_running_requests"] == 0
            and m["tokenwire_queue_size"] == 0
        ),
        timeout=10,
        interval=0.1,
        what="every KV block free, nothing running or queued",
    )
    after = scrape(main.metrics_port)
    # The engine removed exactly the cancelled 16, and the router counted them as cancelled.
    aborted = after["tokenwire_requests_aborted_total"] - before["tokenwire_requests_aborted_total"]
    assert aborted == 16
    cancelled = after.total("tokenwire_request_failure_total", reason="cancelled") - before.total(
        "tokenwire_request_failure_total", reason="cancelled"
    )
    assert cancelled == 16
    # The shard stopped computing them: a step decodes every running request, so the steps run
    # are the survivors' ~40 (plus prefill chunks), far from the ~400 the cancelled would need.
    steps = after["tokenwire_engine_steps_total"] - before["tokenwire_engine_steps_total"]
    assert steps < 150, steps
    # The survivors are unchanged by their cancelled batch mates.
    expected = await solo(main, keep)
    assert [events[-1].generated_text for events in survivors] == expected
    assert all([e.index for e in events] == list(range(len(events))) for events in survivors)


async def test_shared_prefix_hits_the_prefix_cache_with_the_same_output(
    main: Deployment, tokenizer: Tokenizer
) -> None:
    rng = random.Random(11)
    words = [rng.choice(WORDS) for _ in range(400)]
    text = " ".join(words)
    ids = tokenizer.encode(text).ids
    assert len(ids) > 300
    prefix = tokenizer.decode(ids[:257], skip_special_tokens=True)  # BOS + 256 tokens
    request = pb.GenerateRequest(
        inputs=prefix + " tail", parameters=pb.GenerateParameters(max_new_tokens=8)
    )
    prompt_len = len(tokenizer.encode(request.inputs).ids)
    before = scrape(main.metrics_port)
    first = (await solo(main, [request]))[0]
    middle = scrape(main.metrics_port)
    second = (await solo(main, [request]))[0]
    after = scrape(main.metrics_port)
    first_computed = (
        middle["tokenwire_prefill_tokens_computed_total"]
        - before["tokenwire_prefill_tokens_computed_total"]
    )
    second_computed = (
        after["tokenwire_prefill_tokens_computed_total"]
        - middle["tokenwire_prefill_tokens_computed_total"]
    )
    hits = (
        after["tokenwire_prefix_cache_hit_tokens_total"]
        - middle["tokenwire_prefix_cache_hit_tokens_total"]
    )
    assert second == first
    assert second_computed < first_computed
    assert hits >= 256 - 16 and second_computed <= prompt_len - hits + 1


async def test_request_id_echoed_end_to_end(main: Deployment) -> None:
    async with grpc.aio.insecure_channel(main.target) as channel:
        call = stub(channel).Generate(
            pb.GenerateRequest(inputs="hi", parameters=pb.GenerateParameters(max_new_tokens=1)),
            metadata=(("x-request-id", "e2e-42"),),
        )
        await call
        assert dict(await call.initial_metadata())["x-request-id"] == "e2e-42"
    assert "request_id=e2e-42" in main.router.log_path.read_text()


# --- small KV cache and admission ----------------------------------------------------------


async def test_16_long_requests_with_a_4_sequence_kv_cache_complete_correctly(
    main: Deployment, small_kv: Deployment
) -> None:
    before = scrape(small_kv.metrics_port)
    assert before["tokenwire_kv_blocks_total"] <= 28
    rng = random.Random(3)
    requests = [
        pb.GenerateRequest(
            inputs=prompt(rng, rng.randint(15, 25)),
            parameters=pb.GenerateParameters(max_new_tokens=80),
        )
        for _ in range(16)
    ]
    expected = await solo(main, requests)
    async with grpc.aio.insecure_channel(small_kv.target) as channel:
        results = await asyncio.gather(*(stub(channel).Generate(r, timeout=180) for r in requests))
    assert [r.generated_text for r in results] == expected
    after = scrape(small_kv.metrics_port)
    assert after["tokenwire_preemptions_total"] > before["tokenwire_preemptions_total"]
    assert after["tokenwire_kv_blocks_free"] == after["tokenwire_kv_blocks_total"]


async def test_twice_max_concurrent_requests_excess_is_resource_exhausted(
    small_kv: Deployment,
) -> None:
    rng = random.Random(5)
    requests = [
        pb.GenerateRequest(
            # Long enough that the first 16 are still running when the last request arrives.
            inputs=prompt(rng, 10),
            parameters=pb.GenerateParameters(max_new_tokens=120),
        )
        for _ in range(32)
    ]
    async with grpc.aio.insecure_channel(small_kv.target) as channel:
        await channel.channel_ready()
        results = await asyncio.gather(
            *(stub(channel).Generate(r, timeout=180) for r in requests), return_exceptions=True
        )
    ok = [r for r in results if isinstance(r, pb.GenerateResponse)]
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused), refused[:1]
    assert len(ok) == 16 and len(refused) == 16
    assert "--max-concurrent-requests" in refused[0].details()


# --- shard death ------------------------------------------------------------------------------


async def test_kill_9_shard_ends_streams_unavailable_within_5s_and_not_serving(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    doomed = start_deployment(
        tiny_model_dir,
        tmp_path_factory.mktemp("doomed"),
        router_args=[
            "--max-input-tokens", "64",
            "--max-total-tokens", "1000",
            "--max-batch-prefill-tokens", "128",
            "--max-batch-size", "8",
        ],
    )  # fmt: skip
    try:
        async with grpc.aio.insecure_channel(doomed.target) as channel:
            calls = [
                stub(channel).GenerateStream(
                    pb.GenerateRequest(
                        inputs=f"stream {i}", parameters=pb.GenerateParameters(max_new_tokens=900)
                    )
                )
                for i in range(4)
            ]
            for call in calls:
                await call.read()
            killed_at = time.monotonic()
            doomed.shard.kill9()

            async def outcome(
                call,
            ) -> tuple[float, list[pb.GenerateStreamResponse], grpc.StatusCode]:  # type: ignore[no-untyped-def]
                events: list[pb.GenerateStreamResponse] = []
                try:
                    while (event := await call.read()) is not grpc.aio.EOF:
                        events.append(event)
                except grpc.aio.AioRpcError as err:
                    return time.monotonic() - killed_at, events, err.code()
                return time.monotonic() - killed_at, events, grpc.StatusCode.OK

            ends = await asyncio.wait_for(asyncio.gather(*(outcome(c) for c in calls)), 10)
        for elapsed, events, code in ends:
            assert code == grpc.StatusCode.UNAVAILABLE
            assert elapsed < 5.0
            assert events and events[-1].error_type == "unavailable" and events[-1].error
        await until(
            lambda: health_status(doomed.target) == health_pb2.HealthCheckResponse.NOT_SERVING,
            timeout=5,
        )
        assert doomed.router.alive  # the router stays up, reporting NOT_SERVING
        async with grpc.aio.insecure_channel(doomed.target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub(channel).Generate(pb.GenerateRequest(inputs="after"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        doomed.stop()


# --- graceful drain ---------------------------------------------------------------------------


async def test_sigterm_drains_in_flight_streams_then_exits_zero(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    draining = start_deployment(
        tiny_model_dir,
        tmp_path_factory.mktemp("draining"),
        router_args=[
            "--max-input-tokens", "64",
            "--max-total-tokens", "400",
            "--max-batch-prefill-tokens", "128",
            "--max-batch-size", "8",
            "--graceful-timeout", "60",
        ],
    )  # fmt: skip
    try:
        async with grpc.aio.insecure_channel(draining.target) as channel:
            calls = [
                stub(channel).GenerateStream(
                    pb.GenerateRequest(
                        inputs=f"drain {i}",
                        parameters=pb.GenerateParameters(max_new_tokens=300, details=True),
                    )
                )
                for i in range(3)
            ]
            firsts = [await call.read() for call in calls]
            assert draining.router.popen is not None
            draining.router.popen.send_signal(signal.SIGTERM)
            await until(
                lambda: (
                    health_status(draining.target) == health_pb2.HealthCheckResponse.NOT_SERVING
                ),
                timeout=5,
                interval=0.02,
                what="router NOT_SERVING after SIGTERM",
            )
            # SIGTERM arrived (NOT_SERVING) while the engine was still generating all three.
            assert scrape(draining.metrics_port)["tokenwire_running_requests"] == 3
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub(channel).Generate(pb.GenerateRequest(inputs="late"))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            finished = await asyncio.gather(*(read_all(c, [f]) for c, f in zip(calls, firsts)))
        for events in finished:
            assert events[-1].HasField("generated_text") and not events[-1].HasField("error")
            assert events[-1].details.finish_reason == "length" and len(events) == 300
        exit_code = await asyncio.to_thread(draining.router.popen.wait, 30)
        assert exit_code == 0
    finally:
        draining.stop()
