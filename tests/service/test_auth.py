"""--api-key: generation calls need `authorization: Bearer <key>`; health and reflection do not."""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tokenwire.v1 import generate_pb2 as pb

from tests.helpers.engine_double import ScriptedEngine, expected_text
from tests.helpers.router_harness import rpc_error, running_router

KEY = "s3cret-key"
REQUEST = pb.GenerateRequest(inputs="hi", parameters=pb.GenerateParameters(max_new_tokens=2))


async def test_missing_or_wrong_key_is_unauthenticated(tokenizer_dir: Path) -> None:
    engine = ScriptedEngine()
    async with running_router(engine, tokenizer_dir, api_key=KEY) as router:
        for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", KEY),)):
            for call in (
                router.stub.Generate(REQUEST, metadata=metadata),
                router.stub.GenerateStream(REQUEST, metadata=metadata),
                router.stub.Info(pb.InfoRequest(), metadata=metadata),
            ):
                err = await rpc_error(call)
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
                assert "authorization" in err.details()
                # The failed call still carries its request id: a call that fails before its
                # first message is trailers-only (so Envoy can map the status, and a gateway may
                # retry it on another replica), the id in trailers.
                assert "x-request-id" in dict(await call.trailing_metadata())
                assert "x-request-id" not in dict(await call.initial_metadata())
    assert engine.submitted == []


async def test_right_key_is_accepted(tokenizer_dir: Path) -> None:
    metadata = (("authorization", f"Bearer {KEY}"),)
    async with running_router(ScriptedEngine(), tokenizer_dir, api_key=KEY) as router:
        response = await router.stub.Generate(REQUEST, metadata=metadata)
        events = [e async for e in router.stub.GenerateStream(REQUEST, metadata=metadata)]
        info = await router.stub.Info(pb.InfoRequest(), metadata=metadata)
    assert response.generated_text and events[-1].generated_text == response.generated_text
    assert info.model_id == "tiny-test"


async def test_health_and_reflection_stay_open(tokenizer_dir: Path) -> None:
    async with running_router(ScriptedEngine(), tokenizer_dir, api_key=KEY) as router:
        await router.stub.Health(pb.HealthRequest())
        reply = await health_pb2_grpc.HealthStub(router.channel).Check(
            health_pb2.HealthCheckRequest(service="")
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

        async def requests():
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        stub = reflection_pb2_grpc.ServerReflectionStub(router.channel)
        names = [
            s.name
            async for r in stub.ServerReflectionInfo(requests())
            for s in r.list_services_response.service
        ]
    assert "tokenwire.v1.TextGeneration" in names


async def test_no_key_configured_means_open(tokenizer_dir: Path) -> None:
    # Without --api-key every call is served, with no header or with any header at all.
    engine = ScriptedEngine()
    async with running_router(engine, tokenizer_dir) as router:
        for metadata in ((), (("authorization", "Bearer anything"),)):
            response = await router.stub.Generate(REQUEST, metadata=metadata)
            events = [e async for e in router.stub.GenerateStream(REQUEST, metadata=metadata)]
            info = await router.stub.Info(pb.InfoRequest(), metadata=metadata)
            assert response.generated_text == expected_text(engine.submitted[-1])
            assert events[-1].generated_text == response.generated_text
            assert info.model_id == "tiny-test"
    assert len(engine.submitted) == 4
