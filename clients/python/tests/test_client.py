"""Unit tests of tokenwire_client against an in-process fake TextGeneration server.

The fake is a plain grpcio server that speaks the generated betterproto2 messages, so these tests
need only the SDK's own dependencies plus pytest: `pip install -e clients/python[test]`, then
`pytest clients/python/tests`. (tests/sdk runs them in the fresh virtualenv of the wheel.)
They cover what a healthy real server does not show: API keys, in-band stream errors, overload,
and that an early cancel reaches the server.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import tokenwire_client as tw
from tokenwire_client._async import split_target
from tokenwire_client._generated.tokenwire.v1 import (
    GenerateRequest,
    GenerateResponse,
    GenerateStreamResponse,
    HealthRequest,
    HealthResponse,
    InfoRequest,
    InfoResponse,
    Token,
)
from tokenwire_client._request import build_chat_request, build_request

API_KEY = "s3cret"


class FakeServer:
    """Generates " tok" per token (10 ms each). Inputs steer it: "busy" is RESOURCE_EXHAUSTED,
    "fail" fails the stream in band after one event. Records cancelled streams."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.healthy = True
        self.seen_auth: list[str | None] = []

    def _check(self, request: GenerateRequest, context: grpc.ServicerContext) -> int:
        auth = dict(context.invocation_metadata()).get("authorization")
        self.seen_auth.append(auth)
        if auth != f"Bearer {API_KEY}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")
        if request.inputs == "busy":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests in flight")
        if not request.inputs:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "inputs must not be empty")
        params = request.parameters
        return params.max_new_tokens if params and params.max_new_tokens is not None else 5

    def generate(self, request: GenerateRequest, context: grpc.ServicerContext) -> GenerateResponse:
        n = self._check(request, context)
        return GenerateResponse(generated_text=" tok" * n)

    def generate_stream(
        self, request: GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[GenerateStreamResponse]:
        n = self._check(request, context)
        context.add_callback(lambda: None if context.is_active() else self.cancelled.set())
        for i in range(n):
            time.sleep(0.01)
            if not context.is_active():
                self.cancelled.set()
                return
            if request.inputs == "fail" and i == 1:
                yield GenerateStreamResponse(index=i, error="shard 0 died", error_type="generation")
                return
            yield GenerateStreamResponse(
                index=i,
                token=Token(id=i, text=" tok"),
                generated_text=" tok" * n if i == n - 1 else None,
            )

    def info(self, request: InfoRequest, context: grpc.ServicerContext) -> InfoResponse:
        return InfoResponse(model_id="fake", version="0.1.0", router="tokenwire-router")

    def health(self, request: HealthRequest, context: grpc.ServicerContext) -> HealthResponse:
        if not self.healthy:
            context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        return HealthResponse()

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(fn, req):  # type: ignore[no-untyped-def]
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=req.FromString, response_serializer=bytes
            )

        return grpc.method_handlers_generic_handler(
            "tokenwire.v1.TextGeneration",
            {
                "Generate": unary(self.generate, GenerateRequest),
                "GenerateStream": grpc.unary_stream_rpc_method_handler(
                    self.generate_stream,
                    request_deserializer=GenerateRequest.FromString,
                    response_serializer=bytes,
                ),
                "Info": unary(self.info, InfoRequest),
                "Health": unary(self.health, HealthRequest),
            },
        )


@pytest.fixture
def fake() -> Iterator[tuple[FakeServer, str]]:
    servicer = FakeServer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((servicer.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


# ---- request building, errors, targets (no server) ------------------------------------------


def test_parameters_become_the_request_message() -> None:
    request = build_request(
        "hi",
        {
            "max_new_tokens": 3,
            "stop": ("a", "b"),
            "seed": None,
            "details": True,
            "grammar": {"type": "json", "value": {"type": "object"}},
        },
    )
    assert request.inputs == "hi"
    assert request.parameters.max_new_tokens == 3 and request.parameters.stop == ["a", "b"]
    assert request.parameters.seed is None and request.parameters.details is True
    assert request.parameters.grammar.type == "json"
    assert request.parameters.grammar.value.to_dict() == {"type": "object"}
    assert GenerateRequest.parse(bytes(request)) == request


def test_openai_shaped_structured_output_fields_become_messages() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = build_chat_request(
        "tgi",
        [
            {"role": "user", "content": "add"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "add", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "content": "1", "tool_call_id": "c1"},
        ],
        {
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "n", "schema": schema, "strict": True}},
            "tools": [{"type": "function", "function": {"name": "add", "parameters": schema}}],
            "tool_choice": {"type": "function", "function": {"name": "add"}},
            "parallel_tool_calls": False,
        },
    )
    assert request.response_format.json_schema.schema.to_dict() == schema
    assert request.response_format.json_schema.strict is True
    assert request.tools[0].function.name == "add"
    assert request.tools[0].function.parameters.to_dict() == schema
    assert request.tool_choice.function == "add" and request.parallel_tool_calls is False
    assert request.messages[1].tool_calls[0].function.arguments == '{"a": 1}'
    assert build_chat_request("tgi", [], {"tool_choice": "required"}).tool_choice.mode == "required"


def test_unknown_parameters_and_bad_inputs_are_type_errors() -> None:
    with pytest.raises(TypeError, match="max_tokens"):
        build_request("hi", {"max_tokens": 3})
    with pytest.raises(TypeError, match="inputs"):
        build_request(b"hi", {})  # type: ignore[arg-type]


def test_errors_form_one_hierarchy() -> None:
    assert issubclass(tw.ValidationError, ValueError)
    assert issubclass(tw.DeadlineExceededError, TimeoutError)
    assert issubclass(tw.UnsupportedError, tw.ValidationError)
    error = tw.OverloadedError("queue full")
    assert (error.code, error.message, str(error)) == (
        "RESOURCE_EXHAUSTED",
        "queue full",
        "RESOURCE_EXHAUSTED: queue full",
    )


def test_split_target() -> None:
    assert split_target("localhost:50051") == ("localhost", 50051)
    assert split_target("[::1]:8080") == ("::1", 8080)
    with pytest.raises(ValueError):
        split_target("localhost")


# ---- sync client ---------------------------------------------------------------------------


def test_sync_sends_the_api_key_and_maps_its_absence(fake: tuple[FakeServer, str]) -> None:
    servicer, target = fake
    with tw.Client(target, api_key=API_KEY, timeout=10) as client:
        assert client.generate("hi", max_new_tokens=2).generated_text == " tok tok"
        assert [e.index for e in client.generate_stream("hi", max_new_tokens=3)] == [0, 1, 2]
    assert servicer.seen_auth == [f"Bearer {API_KEY}"] * 2
    with tw.Client(target, timeout=10) as client, pytest.raises(tw.UnauthenticatedError):
        client.generate("hi")


def test_sync_typed_errors(fake: tuple[FakeServer, str]) -> None:
    servicer, target = fake
    with tw.Client(target, api_key=API_KEY, timeout=10) as client:
        with pytest.raises(tw.OverloadedError, match="in flight"):
            client.generate("busy")
        stream = client.generate_stream("fail", max_new_tokens=5)
        assert next(stream).index == 0
        with pytest.raises(tw.GenerationError, match="shard 0 died"):
            next(stream)
        servicer.healthy = False
        assert client.health() is False
        assert client.info().model_id == "fake"


def test_sync_cancel_reaches_the_server(fake: tuple[FakeServer, str]) -> None:
    servicer, target = fake
    with tw.Client(target, api_key=API_KEY, timeout=10) as client:
        with client.generate_stream("hi", max_new_tokens=500) as stream:
            first = next(stream)
        assert first.index == 0
        assert list(stream) == []  # cancelled: iteration is over
    assert servicer.cancelled.wait(5), "the server never saw the cancellation"


# ---- async client --------------------------------------------------------------------------


def test_async_api_key_errors_and_cancel(fake: tuple[FakeServer, str]) -> None:
    servicer, target = fake

    async def scenario() -> None:
        async with tw.AsyncClient(target, api_key=API_KEY, timeout=10) as client:
            assert (await client.generate("hi", max_new_tokens=1)).generated_text == " tok"
            with pytest.raises(tw.OverloadedError):
                await client.generate("busy")
            with pytest.raises(tw.GenerationError, match="shard 0 died"):
                async for _ in client.generate_stream("fail"):
                    pass
            async with client.generate_stream("hi", max_new_tokens=500) as stream:
                async for event in stream:
                    assert event.index == 0
                    break
            servicer.healthy = False
            assert await client.health() is False
        async with tw.AsyncClient(target, timeout=10) as client:
            with pytest.raises(tw.UnauthenticatedError):
                await client.generate("hi")

    asyncio.run(scenario())
    assert servicer.cancelled.wait(5), "the server never saw the cancellation"
