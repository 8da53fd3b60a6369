"""CPU per streamed token of the router's GenerateStream path alone: the real servicer,
interceptors, GenerationService and grpc.aio over loopback (client and server in this one
process), over an engine whose streams come pre-filled (no scheduler, no shard). It isolates
the per-token streaming code from the machine's noise better than benchmarks/router_bench.py
(which needs the whole machine): CPU time (time.process_time) per token, min and median of
several rounds of 64 concurrent streams.

    .venv/bin/python benchmarks/stream_path_bench.py                    # this checkout
    .venv/bin/python benchmarks/stream_path_bench.py --root /tmp/other  # another checkout (A/B)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


async def _measure(tokens: int, streams: int, rounds: int) -> list[float]:
    from tokenwire.v1 import generate_pb2 as pb

    from service.engine.contracts import (
        EngineStats,
        Finished,
        FinishReason,
        StepEvent,
        TokenInfo,
    )
    from service.engine.event_stream import EventStream
    from tests.helpers.models import write_tokenizer_dir
    from tests.helpers.router_harness import running_router

    class PrefilledEngine:
        """Engine whose every request's events are all queued at submit."""

        healthy = True

        def submit(self, request: Any) -> EventStream:
            stream = EventStream(None)
            for i in range(tokens - 1):
                stream.push(StepEvent(TokenInfo(100 + i % 50, " tok", -0.5, False)))
            done = Finished("x", tokens, FinishReason.LENGTH, None)
            stream.push(StepEvent(TokenInfo(7, " end", -0.5, False), finished=done))
            stream._closed = True
            return stream

        def stats(self) -> EngineStats:
            return EngineStats()

        def list_adapters(self) -> list[Any]:
            return []

    tokdir = write_tokenizer_dir(Path(tempfile.mkdtemp(prefix="stream-bench-")))
    engine: Any = PrefilledEngine()
    async with running_router(engine, tokdir, max_concurrent_requests=streams * 2) as router:
        request = pb.GenerateRequest(
            inputs="hello world", parameters=pb.GenerateParameters(max_new_tokens=tokens)
        )

        async def one() -> None:
            n = 0
            async for _ in router.stub.GenerateStream(request):
                n += 1
            assert n == tokens, n

        await asyncio.gather(*(one() for _ in range(streams)))  # warm-up
        per_token = []
        for _ in range(rounds):
            t0 = time.process_time()
            await asyncio.gather(*(one() for _ in range(streams)))
            per_token.append((time.process_time() - t0) / (streams * tokens) * 1e6)
        return per_token


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                   help="checkout whose service/ and gen/python are measured")  # fmt: skip
    p.add_argument("--tokens", type=int, default=80, help="tokens per stream (<= 88)")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    sys.path[:0] = [str(args.root), str(args.root / "gen" / "python")]
    per_token = sorted(asyncio.run(_measure(args.tokens, args.streams, args.rounds)))
    print(f"root={args.root} us_per_token min {per_token[0]:.2f} "
          f"median {per_token[len(per_token) // 2]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
