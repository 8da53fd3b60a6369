"""A stand-in tokenwire.v1.TextGeneration server for developing the SDKs without the real router.

Development only: the acceptance tests in this folder run against the real `tokenwire launch`.
Behaviour: every generated token is " tok"; `inputs == ""` or an out-of-range top_p is
INVALID_ARGUMENT; each token takes 20 ms; "fail-in-band" fails the stream after one event;
a wrong API key (when --api-key is given) is UNAUTHENTICATED.

    python tests/sdk/fake_server.py --port 50051 [--api-key KEY]
"""

from __future__ import annotations

import argparse
import asyncio

import grpc
from tokenwire.v1 import generate_pb2 as pb
from tokenwire.v1 import generate_pb2_grpc as pb_grpc

TOKEN_DELAY_S = 0.02


class FakeTextGeneration(pb_grpc.TextGenerationServicer):
    def __init__(self, api_key: str | None) -> None:
        self.api_key = api_key

    async def _check(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> int:
        if self.api_key is not None:
            metadata = dict(context.invocation_metadata() or ())
            if metadata.get("authorization") != f"Bearer {self.api_key}":
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")
        if not request.inputs:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "inputs must not be empty")
        params = request.parameters
        if params.HasField("top_p") and not 0 < params.top_p <= 1:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"parameters.top_p must be in (0, 1]; got {params.top_p:g}",
            )
        return params.max_new_tokens if params.HasField("max_new_tokens") else 20

    async def Generate(self, request, context):
        n = await self._check(request, context)
        await asyncio.sleep(TOKEN_DELAY_S * n)
        response = pb.GenerateResponse(generated_text=" tok" * n)
        if request.parameters.details:
            response.details.finish_reason = "length"
            response.details.generated_tokens = n
            for i in range(n):
                response.details.tokens.add(id=i, text=" tok", logprob=-1.0)
        return response

    async def GenerateStream(self, request, context):
        n = await self._check(request, context)
        for i in range(n):
            await asyncio.sleep(TOKEN_DELAY_S)
            if request.inputs == "fail-in-band" and i == 1:
                yield pb.GenerateStreamResponse(
                    index=i, error="shard 0 failed", error_type="generation"
                )
                return
            event = pb.GenerateStreamResponse(index=i, token=pb.Token(id=i, text=" tok"))
            if i == n - 1:
                event.generated_text = " tok" * n
                if request.parameters.details:
                    event.details.finish_reason = "length"
                    event.details.generated_tokens = n
            yield event

    async def Info(self, request, context):
        return pb.InfoResponse(
            model_id="fake",
            model_dtype="float32",
            model_device_type="cpu",
            router="tokenwire-router",
            version="0.1.0",
            max_input_tokens=100,
            max_total_tokens=200,
            max_concurrent_requests=8,
        )

    async def Health(self, request, context):
        return pb.HealthResponse()


async def serve(port: int, api_key: str | None) -> None:
    server = grpc.aio.server()
    pb_grpc.add_TextGenerationServicer_to_server(FakeTextGeneration(api_key), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.api_key))


if __name__ == "__main__":
    main()
