"""Resident memory of a bare `grpc.aio` server per cancelled server stream (issue 29's residual).

    python benchmarks/grpc_cancel_leak.py [--calls 9000] [--rounds 5]

No tokenwire code: an aio server with one server-streaming method (the standard health service's
Watch, --messages messages 2 ms apart) in a thread of this process; a client subprocess (6 threads, sync
API) opens streams and, per mode, reads them to the end (`complete`), or cancels each after its
first message with the handler re-raising the cancellation (`cancel`, what tokenwire's handlers
do) or catching it and returning normally (`cancel-return`). Prints this process's RSS after every
round of `--calls` streams, and the growth per stream after the first round.

grpcio's aio layer frees a batch's gpr_malloc'd grpc_op array only when the awaiting coroutine
consumes the batch's completion; a batch that fails on a cancelled call, or whose awaiter is
cancelled, leaks it (grpc/grpc issue 43360, fixes proposed in PRs 43361 and 43409, not released
as of grpcio 1.85.1). This script shows the per-stream cost on the installed grpcio.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading
import time

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

CLIENT = r"""
import sys, threading
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
port, calls, cancel = sys.argv[1], int(sys.argv[2]), sys.argv[3] != "complete"
stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
def run(n):
    for i in range(n):
        stream = stub.Watch(health_pb2.HealthCheckRequest(service=f"s{i}"))
        if cancel:
            next(stream)
            stream.cancel()
        else:
            for _ in stream:
                pass
threads = [threading.Thread(target=run, args=(calls // 6,)) for _ in range(6)]
[t.start() for t in threads]
[t.join() for t in threads]
"""


class Streams(health_pb2_grpc.HealthServicer):
    def __init__(self, return_on_cancel: bool, messages: int) -> None:
        self.return_on_cancel = return_on_cancel
        self.messages = messages

    async def Watch(self, request, context):  # noqa: N802 - the generated name
        try:
            for _ in range(self.messages):
                yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
                await asyncio.sleep(0.002)
        except asyncio.CancelledError:
            if self.return_on_cancel:
                return
            raise


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=9000, help="streams per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--messages", type=int, default=50, help="messages per stream (2 ms apart)")
    ap.add_argument("--mode", choices=("cancel", "cancel-return", "complete"), default="cancel")
    args = ap.parse_args()
    ports: list[int] = []

    async def serve() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(Streams(args.mode == "cancel-return", args.messages), server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    threading.Thread(target=lambda: asyncio.run(serve()), daemon=True).start()
    while not ports:
        time.sleep(0.05)
    me = psutil.Process()
    rss = []
    for r in range(args.rounds):
        subprocess.run([sys.executable, "-c", CLIENT, str(ports[0]), str(args.calls), args.mode],
                       check=True)
        rss.append(me.memory_info().rss)
        print(f"{args.mode}: round {r}, {(r + 1) * args.calls} streams, RSS "
              f"{rss[-1] / 2**20:.2f} MiB", flush=True)
    per = (rss[-1] - rss[0]) / ((args.rounds - 1) * args.calls)
    print(f"{args.mode}: grpcio {grpc.__version__}, {per:.0f} bytes of RSS per stream after round 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
