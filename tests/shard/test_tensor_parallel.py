"""`tokenwire shard --world-size 2` (two processes, gloo) generates exactly what one shard does.

Every RPC goes to both ranks at once (as the router does); both answers must agree, and rank 0's
must equal the single-shard engine's and transformers'. Random tiny models and one trained on the
progression task (confident choices, as issue 8's "greedy tokens equal TP=1" presumes).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from reference import hf_greedy, load_hf, prompts
from shard_driver import RouterSim, engine_call
from test_engine_greedy import N, joining_and_leaving, make_shard
from tokenwire.shard.v1 import shard_pb2 as pb
from tokenwire.shard.v1 import shard_pb2_grpc

from shard.tools.tiny_model import TinyModelSpec, make_tiny_model
from shard.tools.tiny_training import task_continuation, task_prompts
from tests.helpers.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def _strip(message):
    """A copy without step timings (they differ per rank)."""
    copy = type(message)()
    copy.CopyFrom(message)
    if "timings" in copy.DESCRIPTOR.fields_by_name:
        copy.ClearField("timings")
    return copy


def run_scenario(call, num_blocks: int, block_size: int, inputs: list[list[int]]
                 ) -> dict[int, list[int]]:
    sim = RouterSim(call, num_blocks, block_size)
    joining_and_leaving(sim, inputs)
    return {rid: req.generated for rid, req in sim.done.items()}


def two_rank_scenario(model_dir: Path, tmp_path: Path, inputs: list[list[int]]
                      ) -> dict[int, list[int]]:
    """joining_and_leaving through `tokenwire shard --world-size 2` (two processes, gloo); every
    RPC goes to both ranks, whose answers must agree. Returns rank 0's tokens per request."""
    prefix = str(tmp_path / "shard")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "service.app.cli", "shard", "--model-id", str(model_dir),
             "--device", "cpu", "--rank", str(r), "--world-size", "2", "--uds-path", prefix,
             "--master-port", str(port), "--kv-cache-memory-mb", "1", "--log-level", "WARNING"],
            cwd=REPO, env=env,
        )
        for r in range(2)
    ]
    channels = [grpc.insecure_channel(f"unix://{prefix}-{r}") for r in range(2)]
    try:
        for ch in channels:
            grpc.channel_ready_future(ch).result(timeout=120)
        stubs = [shard_pb2_grpc.ShardServiceStub(ch) for ch in channels]
        pool = ThreadPoolExecutor(2)

        def call(method, request):
            futures = [pool.submit(getattr(s, method), request, timeout=120) for s in stubs]
            answers = [f.result() for f in futures]
            if method != "Warmup":  # warmup_ns differs; everything else must agree
                assert all(_strip(a) == _strip(answers[0]) for a in answers[1:]), method
            return answers[0]

        info = call("Info", pb.InfoRequest())
        assert info.world_size == 2
        urls = list(call("ServiceDiscovery", pb.ServiceDiscoveryRequest()).urls)
        assert urls == [f"unix://{prefix}-0", f"unix://{prefix}-1"]
        warm = call("Warmup", pb.WarmupRequest(
            max_input_tokens=128, max_total_tokens=256, max_batch_prefill_tokens=256,
            max_batch_size=8, max_batch_total_tokens=2048))
        tp = run_scenario(call, warm.num_blocks, warm.block_size, inputs)
    finally:
        for ch in channels:
            ch.close()
        for p in procs:
            p.terminate()
        codes = [p.wait(timeout=30) for p in procs]
    assert codes == [0, 0]
    return tp


def single_shard_scenario(model_dir: Path, inputs: list[list[int]]) -> dict[int, list[int]]:
    single = make_shard(model_dir)
    return run_scenario(
        engine_call(single), single.runner.num_blocks, single.runner.block_size, inputs
    )


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "qwen2", "trained-llama"])
def test_two_ranks_equal_single_shard(tiny_models, trained_tiny_models, tmp_path, model):
    if model.startswith("trained-"):  # in-distribution prompts: the progression task's
        model_dir = trained_tiny_models(model.removeprefix("trained-"))
        inputs = task_prompts((17, 5, 45, 30))
    else:
        model_dir = tiny_models[model]
        inputs = prompts(model_dir, [17, 5, 45, 30])
    tp = two_rank_scenario(model_dir, tmp_path, inputs)
    assert tp == single_shard_scenario(model_dir, inputs)
    hf = load_hf(model_dir)
    assert tp[1] == hf_greedy(hf, inputs[0], N)
    if model.startswith("trained-"):
        assert tp[1] == task_continuation(inputs[0], N)
        assert tp[3] == task_continuation(inputs[2], N)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_kv_head_replicated_over_two_ranks(tmp_path, arch):
    """Multi-query attention (1 KV head, 4 query heads) at world size 2: both ranks load the one
    KV head (qwen2: its bias too) and greedy output equals one shard's and transformers'."""
    model_dir = make_tiny_model(tmp_path / "model", TinyModelSpec(arch=arch, num_kv_heads=1))
    inputs = prompts(model_dir, [17, 5, 45, 30])
    tp = two_rank_scenario(model_dir, tmp_path, inputs)
    assert tp == single_shard_scenario(model_dir, inputs)
    assert tp[1] == hf_greedy(load_hf(model_dir), inputs[0], N)
