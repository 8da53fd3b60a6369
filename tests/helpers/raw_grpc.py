"""The public API over raw gRPC (generated stubs, no SDK): the reference the SDK tests compare
their results with."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
from tokenwire.v1 import generate_pb2 as pb
from tokenwire.v1 import generate_pb2_grpc


@dataclass(frozen=True)
class RawClient:
    target: str
    timeout: float = 60.0

    @contextmanager
    def _stub(self) -> Iterator[generate_pb2_grpc.TextGenerationStub]:
        with grpc.insecure_channel(self.target) as channel:
            yield generate_pb2_grpc.TextGenerationStub(channel)

    def _generate(self, inputs: str, **params: object) -> pb.GenerateResponse:
        request = pb.GenerateRequest(inputs=inputs, parameters=pb.GenerateParameters(**params))
        with self._stub() as stub:
            return stub.Generate(request, timeout=self.timeout)

    def generate(self, inputs: str, **params: object) -> dict[str, object]:
        """{"text", "ids", "finish_reason"} of a unary Generate (ids and reason need details)."""
        reply = self._generate(inputs, **params)
        details = reply.details if reply.HasField("details") else None
        return {
            "text": reply.generated_text,
            "ids": [t.id for t in details.tokens] if details else [],
            "finish_reason": details.finish_reason if details else None,
        }

    def _events(self, inputs: str, **params: object) -> list[pb.GenerateStreamResponse]:
        request = pb.GenerateRequest(inputs=inputs, parameters=pb.GenerateParameters(**params))
        with self._stub() as stub:
            return list(stub.GenerateStream(request, timeout=self.timeout))

    def stream(self, inputs: str, **params: object) -> dict[str, object]:
        """{"text", "ids", "finish_reason"} of a whole GenerateStream."""
        events = self._events(inputs, **params)
        last = events[-1]
        return {
            "text": last.generated_text,
            "ids": [e.token.id for e in events],
            "finish_reason": last.details.finish_reason if last.HasField("details") else None,
        }

    def token_texts(self, inputs: str, **params: object) -> list[str]:
        """Each streamed event's token text, in order."""
        return [e.token.text for e in self._events(inputs, **params)]

    def info(self) -> pb.InfoResponse:
        with self._stub() as stub:
            return stub.Info(pb.InfoRequest(), timeout=self.timeout)

    def validation_message(self, inputs: str, **params: object) -> str:
        """The INVALID_ARGUMENT message of a request that must be rejected."""
        try:
            self._generate(inputs, **params)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
            return str(error.details())
        raise AssertionError("the request was accepted")
