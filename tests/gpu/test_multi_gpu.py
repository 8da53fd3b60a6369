"""Tensor parallelism over NCCL on two GPUs (run on the device kind with 2 GPUs).

`pytest -m gpu tests/gpu`; skipped with fewer than two CUDA devices. Ranks are real processes,
one per GPU, spawned through the same helper (shard.testing.ranks) as the benchmark harness's
`--num-shard` runs.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA devices",
    ),
]


def test_symmetric_memory_all_reduce_equals_nccl_and_survives_graph_reuse():
    """Decode-sized tensors take the one-shot path, larger ones NCCL; both give NCCL's exact sum,
    and 64 dependent all-reduces captured in one CUDA graph stay exact over replays (the staging
    buffer is never overwritten while a peer still reads it)."""
    from benchmarks.harness.tp import bench_rank
    from shard.testing.ranks import run_ranks

    res = run_ranks(2, {"device": "cuda", "allreduce_batches": [1, 64, 256]}, bench_rank,
                    timeout_s=300)
    assert res.get("error") is None, res
    rows = {r["batch"]: r for r in res["allreduce"]}
    assert rows[1]["small_path"] and rows[64]["small_path"]  # 8 KiB, 512 KiB
    assert not rows[256]["small_path"]  # 2 MiB: above the 1 MiB cutoff
    for row in rows.values():
        assert row["equals_nccl"], row
        assert row["chain_exact"], row
    # Not a timing test; kept in the output for the record.
    print({b: (round(r["in_graph_us"], 1), round(r["nccl_in_graph_us"], 1))
           for b, r in rows.items()})


def test_fused_all_reduce_add_rms_norm_equals_unfused_over_graph_replays():
    """Decode-sized row-parallel outputs are summed, added and normalized by one kernel
    (shard.distributed.all_reduce_norm): 64 dependent calls, eager and replayed from a CUDA graph with new
    inputs, equal NCCL's all-reduce + the add/norm kernel bit for bit (two ranks), including the
    slot rotation across replays and rows changing between 1 and 16."""
    from benchmarks.harness.tp import bench_rank
    from shard.testing.ranks import run_ranks

    res = run_ranks(2, {"device": "cuda", "allreduce_batches": [1, 16]}, bench_rank,
                    timeout_s=300)
    assert res.get("error") is None, res
    rows = {r["batch"]: r for r in res["fused_norm"]}
    assert set(rows) == {1, 16}
    for row in rows.values():
        assert row["fused_path"], row
        assert row["eager_chain_exact"], row
        assert row["graph_chain_exact"], row
    print({b: (round(r["fused_in_graph_us"], 1), round(r["unfused_in_graph_us"], 1))
           for b, r in rows.items()})
    # The row-parallel GEMV pushing its output into the exchange buffers itself (the model's
    # batch-1 decode path; 16 rows take the fused kernel's own push): 32 dependent GEMV +
    # reduce steps equal GEMV + NCCL + add_rms_norm.
    pushed = {r["batch"]: r for r in res["pushed_linear"]}
    assert set(pushed) == {1, 16}
    assert pushed[1]["pushes"] and not pushed[16]["pushes"]
    for row in pushed.values():
        assert row["eager_chain_exact"], row
        assert row["graph_chain_exact"], row
    print({b: (round(r["pushed_step_us"], 1), round(r["unpushed_step_us"], 1),
               round(r["nccl_step_us"], 1), r["dispatched_backend"],
               r["eager_equals_triton_reference"]) for b, r in pushed.items()})


def test_fused_all_reduce_norm_and_pushed_gemv_stress():
    """The same exactness checks over 200 graph replays with new inputs each (64 dependent
    fused calls, 32 pushed-GEMV steps per replay): a race in the exchange protocol (a rank
    reading a slot its peer is still writing) shows up as a wrong number, not as luck."""
    from benchmarks.harness.tp import bench_rank
    from shard.testing.ranks import run_ranks

    res = run_ranks(2, {"device": "cuda", "allreduce_batches": [1, 16], "replays": 200},
                    bench_rank, timeout_s=600)
    assert res.get("error") is None, res
    for row in res["fused_norm"] + res["pushed_linear"]:
        assert row["eager_chain_exact"], row
        assert row["graph_chain_exact"], row


def test_trained_tiny_llama_tp2_greedy_equals_one_gpu(tmp_path):
    """TP=2 (NCCL, one-shot all-reduce, warmup + CUDA graphs) vs one GPU, bf16: 32 greedy tokens
    equal on a tiny model whose choices are clear (trained on the progression task; a random
    model's bf16 near-ties would let rounding order decide)."""
    from shard.testing.ranks import run_ranks
    from shard.testing.tiny import greedy_tokens, load_tiny
    from shard.distributed.groups import Dist
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model
    from shard.tools.tiny_training import RECOMMENDED_STEPS, task_continuation, task_prompts

    model = make_tiny_model(tmp_path / "trained-llama",
                            TinyModelSpec("llama", train_steps=RECOMMENDED_STEPS))
    res = run_ranks(2, {"device": "cuda", "tiny_dirs": {"trained": str(model)}}, timeout_s=300)
    assert res.get("error") is None, res
    assert res["tiny_graphs"]["trained"]
    margins: list = []
    want = greedy_tokens(load_tiny(model, "cuda:0", Dist()), margins=margins)
    assert res["tiny_tokens"]["trained"] == want
    assert want == [task_continuation(p, 32) for p in task_prompts((17, 5, 45))]
    assert min(min(m) for m in margins) > 1.0


def _launch_generate(model_dir, num_shard: int, tmp_path, prompts: list[str],
                     device: str = "cuda", dtype: str = "bfloat16") -> list[list[int]]:
    """`tokenwire launch --num-shard N --device cuda` (real router + shard processes over gRPC),
    greedy 32 tokens per prompt through the public API; returns the generated token ids."""
    import subprocess
    import sys
    import time

    import grpc
    from google.protobuf import json_format
    from tokenwire.v1 import generate_pb2 as pb
    from tokenwire.v1 import generate_pb2_grpc as pb_grpc

    from tests.helpers.ports import free_port
    from tests.helpers.processes import REPO, health_status

    port = free_port()
    log_path = tmp_path / f"launch-{num_shard}.log"
    argv = [sys.executable, "-m", "service.app.cli", "launch", "--model-id", str(model_dir),
            "--device", device, "--dtype", dtype, "--num-shard", str(num_shard),
            "--port", str(port), "--prometheus-port", str(free_port())]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while health_status(f"127.0.0.1:{port}") != 1:  # SERVING
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.5)
        out = []
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.TextGenerationStub(channel)
            for text in prompts:
                body = {"inputs": text, "parameters": {"max_new_tokens": 32, "details": True}}
                reply = stub.Generate(json_format.ParseDict(body, pb.GenerateRequest()),
                                      timeout=120)
                out.append([t.id for t in reply.details.tokens])
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_launch_num_shard_2_on_gpus_equals_one_shard(tmp_path):
    """The shipped path: `launch --num-shard 2` puts rank r on cuda:r (each shard's model thread
    bound to its GPU), the router drives both ranks; greedy output over the public gRPC API equals
    `--num-shard 1` on the trained tiny model."""
    from transformers import AutoTokenizer

    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model
    from shard.tools.tiny_training import RECOMMENDED_STEPS, TASK, task_continuation, task_prompt

    model = make_tiny_model(tmp_path / "trained-llama",
                            TinyModelSpec("llama", train_steps=RECOMMENDED_STEPS))
    tokenizer = AutoTokenizer.from_pretrained(model)

    def round_trips(ids: list[int]) -> bool:  # text that the router tokenizes back to `ids`
        return tokenizer(tokenizer.decode(ids[1:]))["input_ids"] == ids

    # Task prompts whose text tokenizes back exactly (BPE merges break some), one per length.
    ids = [next(p for stride in TASK.strides for start in range(TASK.modulus)
                if round_trips(p := task_prompt(length, stride, start))) for length in (17, 5, 45)]
    prompts = [tokenizer.decode(p[1:]) for p in ids]
    two = _launch_generate(model, 2, tmp_path, prompts)
    one = _launch_generate(model, 1, tmp_path, prompts)
    assert two == one
    assert two == [task_continuation(p, 32) for p in ids]
