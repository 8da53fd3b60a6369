"""The public servicer over gRPC loopback in front of the engine double: responses, streams,
in-band errors, cancellation, deadlines, admission, health, Info, reflection, request ids."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tokenwire.v1 import generate_pb2 as pb

from service.engine.contracts import ShardUnavailableError
from tests.helpers.engine_double import ScriptedEngine, expected_text, token_logprob
from tests.helpers.router_harness import rpc_error, running_router
from tests.helpers.tools import needs
from tests.helpers.waiting import until

REPO = Path(__file__).resolve().parents[2]


def req(inputs: str = "Hello world", **params: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(inputs=inputs, parameters=pb.GenerateParameters(**params))


async def test_generate_returns_text_and_details(tokenizer_dir: Path) -> None:
    engine = ScriptedEngine()
    async with running_router(engine, tokenizer_dir) as router:
        response = await router.stub.Generate(req(max_new_tokens=5, details=True))
    sent = engine.submitted[0]
    assert response.generated_text == expected_text(sent)
    d = response.details
    assert d.finish_reason == "length" and d.generated_tokens == 5
    assert not d.HasField("seed")  # greedy
    assert [t.text for t in d.tokens] == [f"t{t.id} " for t in d.tokens]
    assert d.tokens[0].logprob == pytest.approx(token_logprob(d.tokens[0].id))
    assert len(d.prefill) == 0 and len(d.top_tokens) == 0


async def test_no_details_unless_asked(tokenizer_dir: Path) -> None:
    async with running_router(ScriptedEngine(), tokenizer_dir) as router:
        response = await router.stub.Generate(req(max_new_tokens=2))
    assert not response.HasField("details")


async def test_return_full_text_prepends_prompt(tokenizer_dir: Path) -> None:
    engine = ScriptedEngine()
    async with running_router(engine, tokenizer_dir) as router:
        response = await router.stub.Generate(
            req("Once upon", max_new_tokens=3, return_full_text=True)
        )
    assert response.generated_text == "Once upon" + expected_text(engine.submitted[0])


async def test_decoder_input_details_and_top_n_tokens(tokenizer_dir: Path) -> None:
    engine = ScriptedEngine()
    async with running_router(engine, tokenizer_dir) as router:
        response = await router.stub.Generate(
            req(max_new_tokens=3, decoder_input_details=True, top_n_tokens=2)
        )
    d = response.details
    assert len(d.prefill) == len(engine.submitted[0].input_ids)
    assert not d.prefill[0].HasField("logprob")  # first prompt token has no context
    assert d.prefill[1].logprob == -1.0
    assert len(d.top_tokens) == 3 and all(len(t.tokens) == 2 for t in d.top_tokens)
    assert engine.submitted[0].prefill_logprobs and engine.submitted[0].top_n_tokens == 2


async def test_sampled_request_reports_seed(tokenizer_dir: Path) -> None:
    engine = ScriptedEngine()
    async with running_router(engine, tokenizer_dir) as router:
        response = await router.stub.Generate(
            req(max_new_tokens=2, do_sample=True, seed=7, details=True)
        )
    assert response.details.seed == 7
    assert engine.submitted[0].sampling.seed == 7 and engine.submitted[0].sampling.do_sample


async def test_best_of_returns_best_by_logprob_and_the_others(tokenizer_dir: Path) -> None:
    engine = ScriptedEngine()
    async with running_router(engine, tokenizer_dir) as router:
        response = await router.stub.Generate(
            req(max_new_tokens=4, best_of=2, do_sample=True, seed=3, details=True)
        )
    assert len(engine.submitted) == 2
    assert {r.sampling.seed for r in engine.submitted} == {3, 4}
    d = response.details
    assert len(d.best_of_sequences) == 1
    other = d.best_of_sequences[0]
    assert sum(t.logprob for t in d.tokens) >= sum(t.logprob for t in other.tokens)
    assert {d.seed, other.seed} == {3, 4}
    by_seed = {r.sampling.seed: expected_text(r) for r in engine.submitted}
    assert response.generated_text == by_seed[d.seed]
    assert other.generated_text == by_seed[other.seed]


async def test_stream_events_then_final_text_equal_unary(tokenizer_dir: Path) -> None:
    engine = ScriptedEngine()
    async with running_router(engine, tokenizer_dir) as router:
        events = [e async for e in router.stub.GenerateStream(req(max_new_tokens=6, details=True))]
        unary = await router.stub.Generate(req(max_new_tokens=6))
    assert [e.index for e in events] == list(range(6))
    assert all(not e.HasField("generated_text") for e in events[:-1])
    assert all(not e.HasField("details") for e in events[:-1])
    last = events[-1]
    assert last.generated_text == "".join(e.token.text for e in events) == unary.generated_text
    assert last.details.finish_reason == "length" and last.details.generated_tokens == 6
    assert last.details.input_length == len(engine.submitted[0].input_ids)


async def test_stream_failure_after_first_event_is_in_band_then_status(tokenizer_dir: Path) -> None:
    engine = ScriptedEngine(fail_after=2, fail_with=ShardUnavailableError("shard 0 died"))
    async with running_router(engine, tokenizer_dir) as router:
        call = router.stub.GenerateStream(req(max_new_tokens=6))
        events = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for event in call:
                events.append(event)
        # A shard failure flips health (its callback runs as the stream fails).
        await until(lambda: not router.health.serving, timeout=2, what="health not serving")
        check = await health_pb2_grpc.HealthStub(router.channel).Check(
            health_pb2.HealthCheckRequest()
        )
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(events) == 3
    assert events[-1].error == "shard 0 died" and events[-1].error_type == "unavailable"
    assert events[-1].index == 2 and not events[-1].HasField("token")
    assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_stream_failure_before_first_event_is_status_only(tokenizer_dir: Path) -> None:
    engine = ScriptedEngine(fail_after=0)
    async with running_router(engine, tokenizer_dir) as router:
        call = router.stub.GenerateStream(req(max_new_tokens=3))
        events = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for event in call:
                events.append(event)
    assert events == []
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "boom"


async def test_client_cancel_cancels_engine_stream(tokenizer_dir: Path) -> None:
    engine = ScriptedEngine(token_delay=0.02)
    async with running_router(engine, tokenizer_dir) as router:
        call = router.stub.GenerateStream(req(max_new_tokens=50))
        first = await call.read()
        assert first.index == 0
        call.cancel()
        await until(
            timeout=2, condition=lambda: engine.cancelled == [engine.submitted[0].request_id]
        )
        await until(timeout=2, condition=lambda: router.service.in_flight == 0)


async def test_deadline_is_passed_to_the_engine(tokenizer_dir: Path) -> None:
    engine = ScriptedEngine()
    async with running_router(engine, tokenizer_dir) as router:
        before = time.monotonic()
        await router.stub.Generate(req(max_new_tokens=1), timeout=30)
        assert router.service.in_flight == 0
    deadline = engine.submitted[0].deadline
    assert deadline is not None and before + 25 < deadline < before + 31


async def test_over_max_concurrent_requests_is_resource_exhausted_at_once(
    tokenizer_dir: Path,
) -> None:
    engine = ScriptedEngine()
    engine.gate.clear()  # hold every admitted request before its first token
    async with running_router(engine, tokenizer_dir, max_concurrent_requests=3) as router:
        calls = [router.stub.Generate(req(max_new_tokens=2)) for _ in range(6)]
        tasks = [asyncio.ensure_future(c) for c in calls]
        await until(timeout=2, condition=lambda: sum(t.done() for t in tasks) == 3)
        errors = [t.exception() for t in tasks if t.done()]
        assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in errors)
        assert "--max-concurrent-requests" in errors[0].details()
        engine.gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    assert sum(isinstance(r, pb.GenerateResponse) for r in results) == 3


async def test_draining_refuses_new_requests(tokenizer_dir: Path) -> None:
    async with running_router(ScriptedEngine(), tokenizer_dir) as router:
        router.service.start_draining()
        await router.health.set_not_serving("draining")
        err = await rpc_error(router.stub.Generate(req()))
        health_err = await rpc_error(router.stub.Health(pb.HealthRequest()))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert health_err.code() == grpc.StatusCode.UNAVAILABLE


async def test_not_serving_until_ready(tokenizer_dir: Path) -> None:
    async with running_router(ScriptedEngine(), tokenizer_dir, ready=False) as router:
        health = health_pb2_grpc.HealthStub(router.channel)
        for service in ("", "tokenwire.v1.TextGeneration"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert (await rpc_error(router.stub.Generate(req()))).code() == grpc.StatusCode.UNAVAILABLE
        assert (await rpc_error(router.stub.Health(pb.HealthRequest()))).code() == (
            grpc.StatusCode.UNAVAILABLE
        )
        router.servicer.attach(router.service, None)  # type: ignore[arg-type]
        await router.health.set_ready()
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await router.stub.Health(pb.HealthRequest())


async def test_info_reports_limits(tokenizer_dir: Path) -> None:
    async with running_router(ScriptedEngine(), tokenizer_dir, max_concurrent_requests=7) as router:
        info = await router.stub.Info(pb.InfoRequest())
    assert info.model_id == "tiny-test" and info.router == "tokenwire-router"
    assert (info.max_concurrent_requests, info.max_input_tokens, info.max_total_tokens) == (
        7,
        64,
        96,
    )
    assert (info.max_best_of, info.max_stop_sequences, info.max_top_n_tokens) == (2, 4, 5)
    assert info.num_kv_blocks == 64 and info.block_size == 16
    assert not info.HasField("model_sha") and info.model_pipeline_tag == "text-generation"


async def test_request_id_is_honoured_or_generated_and_echoed(tokenizer_dir: Path) -> None:
    engine = ScriptedEngine()
    async with running_router(engine, tokenizer_dir) as router:
        call = router.stub.Generate(req(max_new_tokens=1), metadata=(("x-request-id", "abc-123"),))
        await call
        assert dict(await call.initial_metadata())["x-request-id"] == "abc-123"
        stream = router.stub.GenerateStream(req(max_new_tokens=1))
        _ = [e async for e in stream]
        generated = dict(await stream.initial_metadata())["x-request-id"]
        bad = router.stub.Generate(req(max_new_tokens=1), metadata=(("x-request-id", "a b" * 100),))
        await bad
        replaced = dict(await bad.initial_metadata())["x-request-id"]
        failed = router.stub.Generate(req(""), metadata=(("x-request-id", "err-1"),))
        await rpc_error(failed)
        # A failed unary call is trailers-only (a gateway may retry it elsewhere): id in trailers.
        assert dict(await failed.trailing_metadata())["x-request-id"] == "err-1"
    assert engine.submitted[0].request_id == "abc-123"
    assert re.fullmatch(r"[0-9a-f]{32}", generated) and engine.submitted[1].request_id == generated
    assert re.fullmatch(r"[0-9a-f]{32}", replaced)


async def test_reflection_lists_every_service(tokenizer_dir: Path) -> None:
    async with running_router(ScriptedEngine(), tokenizer_dir) as router:
        stub = reflection_pb2_grpc.ServerReflectionStub(router.channel)

        async def requests():
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        names = set()
        async for reply in stub.ServerReflectionInfo(requests()):
            names |= {s.name for s in reply.list_services_response.service}
    assert {
        "tokenwire.v1.TextGeneration",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names


@needs((REPO / "node_modules/.bin/buf").exists(), "buf not installed (npm ci)")
async def test_buf_curl_lists_and_calls_through_reflection(tokenizer_dir: Path) -> None:
    buf = str(REPO / "node_modules/.bin/buf")
    async with running_router(ScriptedEngine(), tokenizer_dir) as router:
        base = [buf, "curl", "--protocol", "grpc", "--http2-prior-knowledge"]
        url = f"http://{router.target}"

        def run(*args: str) -> str:
            out = subprocess.run(
                [*base, *args], capture_output=True, text=True, timeout=60, check=False
            )
            assert out.returncode == 0, out.stderr
            return out.stdout

        listed = await asyncio.to_thread(run, "--list-services", url)
        called = await asyncio.to_thread(
            run, "-d", '{"inputs": "hi", "parameters": {"max_new_tokens": 2}}',
            f"{url}/tokenwire.v1.TextGeneration/Generate",
        )  # fmt: skip
    assert "tokenwire.v1.TextGeneration" in listed and "grpc.health.v1.Health" in listed
    assert "generatedText" in called or "generated_text" in called


async def test_special_tokens_are_not_part_of_generated_text(tokenizer_dir: Path) -> None:
    engine = ScriptedEngine(special_at=(1,))
    async with running_router(engine, tokenizer_dir) as router:
        unary = await router.stub.Generate(req(max_new_tokens=3, details=True))
        events = [e async for e in router.stub.GenerateStream(req(max_new_tokens=3))]
    assert unary.details.tokens[1].special and unary.details.tokens[1].text == "<s>"
    assert "<s>" not in unary.generated_text
    assert events[-1].generated_text == unary.generated_text
    assert "".join(e.token.text for e in events if not e.token.special) == unary.generated_text


async def test_engine_deadline_is_deadline_exceeded(tokenizer_dir: Path) -> None:
    from service.engine.contracts import DeadlineExceededError

    engine = ScriptedEngine(fail_after=0, fail_with=DeadlineExceededError("deadline passed"))
    async with running_router(engine, tokenizer_dir) as router:
        err = await rpc_error(router.stub.Generate(req(max_new_tokens=3)))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED


class _ContextAt:
    """What `ErrorInterceptor` asks of a call's context: its time left, and abort."""

    def __init__(self, remaining_s: float) -> None:
        self.remaining_s = remaining_s
        self.aborted: list[grpc.StatusCode] = []

    def time_remaining(self) -> float:
        return self.remaining_s

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted.append(code)


async def test_no_status_is_sent_after_the_callers_deadline() -> None:
    """Past the deadline the caller already has DEADLINE_EXCEEDED from its side; aborting then
    races grpc closing the call, which logs an ERROR traceback (seen on a loaded CI run)."""
    from service.api.interceptors import ErrorInterceptor
    from service.engine.contracts import DeadlineExceededError

    error = DeadlineExceededError("the request deadline passed before it finished")
    late, in_time = _ContextAt(-0.01), _ContextAt(2.0)
    with pytest.raises(asyncio.CancelledError):
        await ErrorInterceptor()._abort(late, error)  # type: ignore[arg-type]
    await ErrorInterceptor()._abort(in_time, error)  # type: ignore[arg-type]
    assert late.aborted == [] and in_time.aborted == [grpc.StatusCode.DEADLINE_EXCEEDED]


async def test_engine_overload_and_shard_down_at_submit(tokenizer_dir: Path) -> None:
    from service.engine.contracts import OverloadedError

    engine = ScriptedEngine(submit_error=OverloadedError("engine full"))
    async with running_router(engine, tokenizer_dir) as router:
        err = await rpc_error(router.stub.GenerateStream(req(max_new_tokens=3)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        engine.submit_error = ShardUnavailableError("down")
        err = await rpc_error(router.stub.Generate(req(max_new_tokens=3)))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        await until(lambda: not router.health.serving, timeout=2, what="health not serving")
        assert router.service.in_flight == 0
