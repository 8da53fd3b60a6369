"""`tokenwire shard --profile-from-step N --profile-dir DIR`: a serving shard records its
device timeline (profiler trace + each step's time and the gaps between steps) from step N to
shutdown, over real gRPC."""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import threading
import time

import grpc
import pytest
from reference import prompts
from shard_driver import RouterSim
from test_engine_greedy import joining_and_leaving
from tokenwire.shard.v1 import shard_pb2 as pb
from tokenwire.shard.v1 import shard_pb2_grpc

from shard.distributed.groups import Dist
from shard.runtime import GcPacer
from shard.server import main as shard_main
from shard.server import servicer as servicer_module
from shard.server.loader import Shard, ShardConfig
from shard.server.main import start_server
from shard.server.step_profile import ProfileWindow, StepProfiler

FIRST = 3


def _serve_and_drive(
    shard: Shard, url: str, profiler: StepProfiler | None, model_dir, gc_pacer=None
) -> list[str]:
    """Serves the shard with the profiler, drives a joining/leaving workload through it and
    stops it; returns the kinds of the steps sent (a Prefill or Decode call each), in order."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server, servicer, _ = asyncio.run_coroutine_threadsafe(
        start_server(shard, [url], 0, lambda _m: None, None, profiler, gc_pacer), loop
    ).result(60)
    channel = grpc.insecure_channel(url)
    stub = shard_pb2_grpc.ShardServiceStub(channel)
    try:
        warm = stub.Warmup(
            pb.WarmupRequest(
                max_input_tokens=128,
                max_total_tokens=256,
                max_batch_prefill_tokens=256,
                max_batch_size=8,
                max_batch_total_tokens=2048,
            )
        )
        sent = []

        def call(method: str, request):
            sent.append(method)
            return getattr(stub, method)(request, timeout=60)

        joining_and_leaving(
            RouterSim(call, warm.num_blocks, warm.block_size), prompts(model_dir, [17, 5, 45, 30])
        )
        if gc_pacer is not None:
            time.sleep(0.5)  # idle: longer than the servicer's _IDLE_GC_DELAY_S
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        if profiler is not None:
            asyncio.run_coroutine_threadsafe(servicer.close_profiler(), loop).result(60)
        servicer.close()
        loop.call_soon_threadsafe(loop.stop)
    return [m.lower() for m in sent if m in ("Prefill", "Decode")]


def test_profile_window_written_at_shutdown(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    shard = Shard(ShardConfig(model_id=str(model_dir), kv_cache_memory_mb=1), Dist())
    profiler = StepProfiler(
        ProfileWindow(FIRST, tmp_path / "prof"), shard.engine, shard.runner.device
    )
    sent = _serve_and_drive(shard, f"unix://{tmp_path}/s-0", profiler, model_dir)
    assert shard.engine.gpu_timer is None  # the timer is detached at close
    steps = json.loads((tmp_path / "prof" / "steps.json").read_text())
    # Every Prefill and Decode the router sent is one launched step; warm-up is not counted.
    assert steps["steps"] == len(sent) > FIRST + 5
    assert steps["kinds"] == sent[FIRST:]  # the steps from FIRST on, in order
    assert set(sent[FIRST:]) == {"prefill", "decode"}
    assert len(steps["step_ms"]) == len(sent) - FIRST
    assert len(steps["gaps_ms"]) == len(sent) - FIRST - 1
    assert all(ms > 0 for ms in steps["step_ms"])
    host = steps["host_ms"]  # [arrived, launch start, launch end] per profiled step, in order
    assert len(host) == len(sent) - FIRST and host[0][0] == 0.0
    assert all(a <= b <= c for a, b, c in host)
    assert all(h1[1] >= h0[2] for h0, h1 in itertools.pairwise(host))  # one worker, in order
    with gzip.open(tmp_path / "prof" / "trace.json.gz") as f:
        trace = json.loads(f.read())
    assert trace["traceEvents"]  # the profiler's CPU activity (CUDA activity on a GPU)


def test_window_never_reached_writes_nothing(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    shard = Shard(ShardConfig(model_id=str(model_dir), kv_cache_memory_mb=1), Dist())
    profiler = StepProfiler(
        ProfileWindow(10_000, tmp_path / "prof"), shard.engine, shard.runner.device
    )
    _serve_and_drive(shard, f"unix://{tmp_path}/s-0", profiler, model_dir)
    assert not (tmp_path / "prof").exists()


def test_profile_flags_go_together(tmp_path):
    parser = __import__("argparse").ArgumentParser()
    shard_main.add_arguments(parser)
    args = parser.parse_args(["--model-id", "x", "--profile-from-step", "5"])
    with pytest.raises(SystemExit, match="--profile-dir"):
        shard_main.run(args)


def test_full_collections_wait_until_no_step_is_in_flight(tiny_models, tmp_path):
    """The servicer tells the GC pacer of each step, and lets it collect only once no step
    RPC has been in flight for _IDLE_GC_DELAY_S (the router is idle)."""
    calls: list[tuple[str, float]] = []

    class Recording(GcPacer):
        def idle(self) -> None:
            calls.append(("idle", time.monotonic()))

        def step(self) -> None:
            calls.append(("step", time.monotonic()))

    model_dir = tiny_models["llama"]
    shard = Shard(ShardConfig(model_id=str(model_dir), kv_cache_memory_mb=1), Dist())
    sent = _serve_and_drive(shard, f"unix://{tmp_path}/s-0", None, model_dir, Recording())
    kinds = [k for k, _ in calls]
    assert kinds.count("step") == len(sent) > 5
    assert kinds[-1] == "idle"  # after the last step
    for (k0, t0), (k1, t1) in itertools.pairwise(calls):
        if k1 == "idle":  # never right after a step: only once none followed for a while
            assert k0 == "step" and t1 - t0 >= servicer_module._IDLE_GC_DELAY_S * 0.99
