"""The shard servicer over real gRPC (grpc.aio server on a Unix socket, in-process): Info,
discovery, health, reflection, warmup errors, greedy generation equal to transformers, status
codes."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reference import hf_greedy, load_hf, prompts
from shard_driver import RouterSim
from test_engine_greedy import N, joining_and_leaving
from tokenwire.shard.v1 import shard_pb2 as pb
from tokenwire.shard.v1 import shard_pb2_grpc

from shard.distributed.groups import Dist
from shard.server.loader import Shard, ShardConfig
from shard.server.main import start_server


class ServerThread:
    """Runs the shard's grpc.aio server on its own event loop thread."""

    def __init__(self, shard: Shard, url: str):
        self.loop = asyncio.new_event_loop()
        self.fatal: list[str] = []
        thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        thread.start()
        started = asyncio.run_coroutine_threadsafe(
            start_server(shard, [url], 0, self.fatal.append), self.loop
        )
        self.server, self.servicer, _ = started.result(60)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.servicer.close()
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    model_dir = tiny_models["qwen2"]
    shard = Shard(ShardConfig(model_id=str(model_dir), kv_cache_memory_mb=1), Dist())
    url = f"unix://{tmp_path_factory.mktemp('sock')}/shard-0"
    server = ServerThread(shard, url)
    channel = grpc.insecure_channel(url)
    yield model_dir, channel, shard_pb2_grpc.ShardServiceStub(channel), url
    channel.close()
    server.stop()


def test_info_discovery_health_reflection(served):
    _, channel, stub, url = served
    info = stub.Info(pb.InfoRequest())
    assert (info.model_type, info.dtype, info.device_type) == ("qwen2", "float32", "cpu")
    assert info.block_size == 16 and info.vocab_size == 512 and info.world_size == 1
    assert list(info.eos_token_ids) == [2] and info.max_position_embeddings == 1024
    assert not info.HasField("sliding_window") and info.attention_backend == "torch"
    assert info.model_impl == "native" and not info.cuda_graphs  # qwen2: native code; CPU
    assert list(stub.ServiceDiscovery(pb.ServiceDiscoveryRequest()).urls) == [url]
    stub.Health(pb.HealthRequest())
    check = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="tokenwire.shard.v1.ShardService")
    )
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    answers = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for s in next(answers).list_services_response.service}
    assert "tokenwire.shard.v1.ShardService" in names


def test_warmup_impossible_budget_names_the_flag(served):
    _, _, stub, _ = served
    with pytest.raises(grpc.RpcError) as err:
        # 1 MiB of KV cache (qwen2 tiny: 4 KiB per block) holds 4096 tokens, not 8192... but the
        # model only has 1024 positions: ask for less than that with a cap that cannot hold it.
        stub.Warmup(
            pb.WarmupRequest(
                max_input_tokens=512, max_total_tokens=1000, max_batch_prefill_tokens=512,
                max_batch_size=4, max_batch_total_tokens=256,
            )
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--max-total-tokens" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Warmup(pb.WarmupRequest(max_input_tokens=10, max_total_tokens=4096,
                                     max_batch_prefill_tokens=10, max_batch_size=1))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--max-total-tokens" in err.value.details()


def test_greedy_over_grpc_matches_transformers(served):
    model_dir, _, stub, _ = served
    warm = stub.Warmup(
        pb.WarmupRequest(max_input_tokens=128, max_total_tokens=256, max_batch_prefill_tokens=256,
                         max_batch_size=8, max_batch_total_tokens=2048)
    )
    assert warm.num_blocks == 128 and warm.max_supported_total_tokens == 2048

    def call(method, request):
        return getattr(stub, method)(request, timeout=60)

    sim = RouterSim(call, warm.num_blocks, warm.block_size)
    p = prompts(model_dir, [17, 5, 45, 30])
    joining_and_leaving(sim, p)
    hf = load_hf(model_dir)
    for rid, n in [(1, N), (3, N), (4, 20)]:
        assert sim.done[rid].generated == hf_greedy(hf, p[rid - 1], n), f"request {rid}"
        assert sim.done[rid].finished.finish_reason == pb.FINISH_REASON_LENGTH
    text = "".join(t for g in sim.done[1].generations for t in g.tokens.texts)
    assert text == sim.done[1].finished.text


def test_status_codes(served):
    _, _, stub, _ = served
    with pytest.raises(grpc.RpcError) as err:
        stub.Decode(pb.DecodeRequest(batches=[pb.CachedBatch(id=99, request_ids=[12345])]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "12345" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.FilterBatch(pb.FilterBatchRequest(batch_id=777, request_ids=[]))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=5, requests=[
            pb.Request(id=1, input_ids=[1, 2, 3], cache_len=0, chunk_len=3, blocks=[]),
        ])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "blocks" in err.value.details()
    stub.ClearCache(pb.ClearCacheRequest())


def test_fatal_device_error_is_internal_then_unavailable(tiny_models, tmp_path):
    shard = Shard(ShardConfig(model_id=str(tiny_models["llama"]), kv_cache_memory_mb=1), Dist())
    url = f"unix://{tmp_path}/fatal-0"
    server = ServerThread(shard, url)
    channel = grpc.insecure_channel(url)
    stub = shard_pb2_grpc.ShardServiceStub(channel)
    try:
        stub.Warmup(pb.WarmupRequest(max_input_tokens=16, max_total_tokens=32,
                                     max_batch_prefill_tokens=16, max_batch_size=1))

        def broken(step):
            raise RuntimeError("CUDA error: device-side assert triggered")

        shard.runner.execute = broken
        request = pb.PrefillRequest(batch=pb.Batch(id=1, requests=[pb.Request(
            id=1, input_ids=[1, 5, 6], cache_len=0, chunk_len=3, blocks=[0],
            stopping=pb.StoppingParameters(max_new_tokens=2))]))
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefill(request)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "device-side assert" in err.value.details()
        assert server.fatal and "device-side assert" in server.fatal[0]  # shard.server.main exits 1
        with pytest.raises(grpc.RpcError) as err:
            stub.Health(pb.HealthRequest())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        channel.close()
        server.stop()


def test_a_stuck_process_group_teardown_does_not_hold_the_shard() -> None:
    """A stopping shard gives NCCL's teardown a bounded time, then exits with its own code (a
    4-GPU deployment's shards waited out the launcher's whole 30 s stop allowance)."""
    import subprocess
    import sys

    from tests.helpers.processes import REPO, quiet_env

    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from shard.server import main\n"
        "main._TEARDOWN_S = 0.2\n"
        "main._tear_down_process_group(lambda timeout_s: False, 3)\n"
        "print('returned', flush=True)\n"
        "sys.exit(0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False,
                          timeout=120, cwd=REPO, env=quiet_env())
    # The shard's exit code, without returning into the interpreter's exit (which would wait for
    # the same stuck threads); a teardown that ends returns normally (every 2-shard launch test).
    assert done.returncode == 3 and "returned" not in done.stdout, done.stderr[-2000:]
    assert "teardown still waiting after" in done.stderr
