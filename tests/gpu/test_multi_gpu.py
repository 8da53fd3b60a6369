"""Tensor parallelism over NCCL on two GPUs (run on the device kind with 2 GPUs).

`pytest -m gpu tests/gpu`; skipped with fewer than two CUDA devices. Ranks are real processes,
one per GPU, spawned through the same helper (shard.testing.ranks) as the benchmark harness's
`--num-shard` runs.

Start-up is what costs here (spawned ranks import torch, join NCCL, rendezvous the symmetric
buffers, tune and load kernels), not the checks. So the rank-level tests share ONE launch of two
ranks (the module fixture `ranks`), whose job covers exactly the tests that pytest selected:
run alone (`-k fused_all_reduce_add_rms_norm`, the exactness loop of
benchmarks/run_multi_gpu_device.sh) the fused test still gets a small job of its own. With the
stress test selected, every exactness check of the launch runs over its 200 replays (the fused
test's 3 replays are a subset). The trained tiny model is made once, and the two `launch`
deployments of the last test start side by side.

Every process of the module (the two ranks, this pytest process, the three shard processes of
the `launch` test) shares one GEMV tuning cache (shard/kernels/tuning_cache.py): $TUNING_CACHE_DIR
when set (benchmarks/run_multi_gpu_device.sh shares one across all its runs), else a directory of
this session. So a shape is measured once per module at most: the rank job measures the TP=2
shapes, the one-GPU greedy run the TP=1 ones, and the `launch` deployments read both (their
tuning was most of their start-up: 86 s of warm-up on a 0.3 MiB model, benchmarks/MULTI_GPU.md).
Triton's compiled kernels are shared through its own on-disk cache (~/.triton/cache) already.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA devices",
    ),
]

# Tests whose assertions read the shared launch, and what each needs from its job.
SYMMETRIC = "test_symmetric_memory_all_reduce_equals_nccl_and_survives_graph_reuse"
FUSED = "test_fused_all_reduce_add_rms_norm_equals_unfused_over_graph_replays"
STRESS = "test_fused_all_reduce_norm_and_pushed_gemv_stress"
GREEDY = "test_trained_tiny_llama_tp2_greedy_equals_one_gpu"
STRESS_REPLAYS = 200
GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def trained_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained tiny llama (clear greedy choices), made once for the module; with
    $TRAINED_TINY_DIR set (benchmarks/run_multi_gpu_device.sh), made once for every run naming
    that directory (a seeded build, ~17 s of training): written beside it and renamed into
    place, so a run side by side never reads a half-written model."""
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model
    from shard.tools.tiny_training import RECOMMENDED_STEPS

    spec = TinyModelSpec("llama", train_steps=RECOMMENDED_STEPS)
    if not os.environ.get("TRAINED_TINY_DIR"):
        return make_tiny_model(tmp_path_factory.mktemp("tp") / "trained-llama", spec)
    target = Path(os.environ["TRAINED_TINY_DIR"])
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        mine = make_tiny_model(target.parent / f".{target.name}.{os.getpid()}", spec)
        try:
            mine.rename(target)
        except OSError:  # another run's model got there first: use it
            shutil.rmtree(mine, ignore_errors=True)
            assert (target / "config.json").is_file(), target
    return target


@pytest.fixture(scope="module")
def tuning_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The module's shared GEMV tuning cache, also configured for this pytest process (the
    one-GPU greedy reference) while the module runs. The process's in-memory tuning records
    are dropped on entry: an earlier test module tuning the same weight shapes would otherwise
    leave the one-GPU run nothing to measure into this cache, and the launched deployments
    (which read it) would measure them again (the whole GPU suite on 2 x H200, round 20)."""
    from shard.kernels import tuning_cache
    from shard.layers import decode_linear

    path = (Path(os.environ["TUNING_CACHE_DIR"]) if os.environ.get("TUNING_CACHE_DIR")
            else tmp_path_factory.mktemp("gemv_tuning"))
    previous = tuning_cache.active()
    tuning_cache.configure(tuning_cache.TuningCache(path))
    decode_linear.clear()
    try:
        yield path
    finally:
        tuning_cache.configure(previous)


def rank_job(selected: set[str], trained: Path | None, tuning: Path | None = None
             ) -> dict[str, Any]:
    """The one two-rank job that serves the selected rank-level tests (benchmarks/harness/tp.py's
    bench_rank): the all-reduce rows 64 and 256 only for the symmetric-memory test, 200 graph
    replays per exactness check when the stress test runs, the tiny greedy run when the greedy
    test runs. The fused kernel's warps sweep is a timing and is left out."""
    batches = [1, 16] + ([64, 256] if SYMMETRIC in selected else [])
    if not selected & {SYMMETRIC, FUSED, STRESS}:
        batches = []  # the greedy test alone: no collectives part
    job: dict[str, Any] = {"device": "cuda", "allreduce_batches": batches,
                           "replays": STRESS_REPLAYS if STRESS in selected else 3,
                           "sweep_warps": False}
    if GREEDY in selected and trained is not None:
        job["tiny_dirs"] = {"trained": str(trained)}
    if tuning is not None:
        job["tuning_cache_dir"] = str(tuning)
    return job


def _selected(request: pytest.FixtureRequest) -> set[str]:
    return {item.originalname for item in request.session.items if item.module is request.module}


@pytest.fixture(scope="module")
def ranks(request: pytest.FixtureRequest, tuning_dir: Path) -> dict[str, Any]:
    """Rank 0's results of one two-rank launch serving every selected rank-level test."""
    from benchmarks.harness.tp import bench_rank
    from shard.testing.ranks import run_ranks

    selected = _selected(request)
    trained = request.getfixturevalue("trained_model") if GREEDY in selected else None
    job = rank_job(selected, trained, tuning_dir)
    res = run_ranks(2, job, bench_rank, timeout_s=280)
    res["job"] = job
    return res


def test_symmetric_memory_all_reduce_equals_nccl_and_survives_graph_reuse(ranks):
    """Decode-sized tensors take the one-shot path, larger ones NCCL; both give NCCL's exact sum,
    and 64 dependent all-reduces captured in one CUDA graph stay exact over replays (the staging
    buffer is never overwritten while a peer still reads it)."""
    assert ranks.get("error") is None, ranks
    rows = {r["batch"]: r for r in ranks["allreduce"]}
    assert {1, 64, 256} <= set(rows)
    assert rows[1]["small_path"] and rows[64]["small_path"]  # 8 KiB, 512 KiB
    assert not rows[256]["small_path"]  # 2 MiB: above the 1 MiB cutoff
    for row in rows.values():
        assert row["equals_nccl"], row
        assert row["chain_exact"], row
    # Not a timing test; kept in the output for the record.
    print({b: (round(r["in_graph_us"], 1), round(r["nccl_in_graph_us"], 1))
           for b, r in rows.items()})


def test_fused_all_reduce_add_rms_norm_equals_unfused_over_graph_replays(ranks):
    """Decode-sized row-parallel outputs are summed, added and normalized by one kernel
    (shard.distributed.all_reduce_norm): 64 dependent calls, eager and replayed from a CUDA graph with new
    inputs, equal NCCL's all-reduce + the add/norm kernel bit for bit (two ranks), including the
    slot rotation across replays and rows changing between 1 and 16."""
    assert ranks.get("error") is None, ranks
    assert ranks["job"]["replays"] >= 3
    rows = {r["batch"]: r for r in ranks["fused_norm"]}
    assert set(rows) == {1, 16}
    for row in rows.values():
        assert row["fused_path"], row
        assert row["eager_chain_exact"], str(row.get("eager_first_mismatch", row))
        assert row["graph_chain_exact"], row
    print({b: (round(r["fused_in_graph_us"], 1), round(r["unfused_in_graph_us"], 1))
           for b, r in rows.items()})
    # The row-parallel GEMV pushing its output into the exchange buffers itself (the model's
    # batch-1 decode path; 16 rows take the fused kernel's own push): 32 dependent GEMV +
    # reduce steps equal GEMV + NCCL + add_rms_norm.
    pushed = {r["batch"]: r for r in ranks["pushed_linear"]}
    assert set(pushed) == {1, 16}
    assert pushed[1]["pushes"] and not pushed[16]["pushes"]
    for row in pushed.values():
        assert row["eager_chain_exact"], row
        assert row["graph_chain_exact"], row
    print({b: (round(r["pushed_step_us"], 1), round(r["unpushed_step_us"], 1),
               round(r["nccl_step_us"], 1), r["dispatched_backend"],
               r["eager_equals_triton_reference"]) for b, r in pushed.items()})


def test_fused_all_reduce_norm_and_pushed_gemv_stress(ranks):
    """The same exactness checks over 200 graph replays with new inputs each (64 dependent
    fused calls, 32 pushed-GEMV steps per replay): a race in the exchange protocol (a rank
    reading a slot its peer is still writing) shows up as a wrong number, not as luck."""
    assert ranks.get("error") is None, ranks
    assert ranks["job"]["replays"] == STRESS_REPLAYS
    assert {r["batch"] for r in ranks["fused_norm"]} == {1, 16}
    assert {r["batch"] for r in ranks["pushed_linear"]} == {1, 16}
    for row in ranks["fused_norm"] + ranks["pushed_linear"]:
        assert row["eager_chain_exact"], str(row.get("eager_first_mismatch", row))
        assert row["graph_chain_exact"], row


def test_trained_tiny_llama_tp2_greedy_equals_one_gpu(ranks, trained_model, tuning_dir):
    """TP=2 (NCCL, one-shot all-reduce, warmup + CUDA graphs) vs one GPU, bf16: 32 greedy tokens
    equal on a tiny model whose choices are clear (trained on the progression task; a random
    model's bf16 near-ties would let rounding order decide)."""
    from shard.distributed.groups import Dist
    from shard.testing.tiny import greedy_tokens, load_tiny
    from shard.tools.tiny_training import task_continuation, task_prompts

    assert ranks.get("error") is None, ranks
    assert ranks["tiny_graphs"]["trained"]
    margins: list = []
    want = greedy_tokens(load_tiny(trained_model, "cuda:0", Dist()), margins=margins)
    assert ranks["tiny_tokens"]["trained"] == want
    assert want == [task_continuation(p, GREEDY_TOKENS) for p in task_prompts((17, 5, 45))]
    assert min(min(m) for m in margins) > 1.0


# `launch` limits that cover the test's prompts (at most 45 tokens + 32 new) and keep start-up
# short: decode graphs for batches 1, 2 and 4 instead of the default's 14 buckets up to 256, a
# small worst-case prefill, and a KV cache of 4,096 tokens rather than 90% of the GPU (two
# deployments share cuda:0).
LAUNCH_LIMITS = ("--max-batch-size", "4", "--max-input-tokens", "64", "--max-total-tokens", "128",
                 "--max-batch-prefill-tokens", "128", "--max-batch-total-tokens", "4096")


@contextlib.contextmanager
def _launched(model_dir: Path, num_shard: int, tmp_path: Path, tuning_dir: Path,
              device: str = "cuda", dtype: str = "bfloat16") -> Iterator[tuple[int, Any, Path]]:
    """`tokenwire launch --num-shard N --device cuda` (real router + shard processes over gRPC)
    on the module's tuning cache; yields (port, process, log path) once started, stops it on
    exit."""
    from tests.helpers.ports import free_port
    from tests.helpers.processes import REPO

    port = free_port()
    log_path = tmp_path / f"launch-{num_shard}.log"
    argv = [sys.executable, "-m", "service.app.cli", "launch", "--model-id", str(model_dir),
            "--device", device, "--dtype", dtype, "--num-shard", str(num_shard),
            "--port", str(port), "--prometheus-port", str(free_port()),
            "--tuning-cache-dir", str(tuning_dir), *LAUNCH_LIMITS]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield port, proc, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_serving(deployments: list[tuple[int, Any, Path]], timeout_s: float = 240.0) -> None:
    from tests.helpers.processes import health_status

    deadline = time.monotonic() + timeout_s
    waiting = list(deployments)
    while waiting:
        for port, proc, log_path in list(waiting):
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            if health_status(f"127.0.0.1:{port}") == 1:  # SERVING
                waiting.remove((port, proc, log_path))
        time.sleep(0.5)


def _generate(port: int, prompts: list[str]) -> list[list[int]]:
    """Greedy GREEDY_TOKENS tokens per prompt through the public gRPC API: the token ids."""
    import grpc
    from google.protobuf import json_format
    from tokenwire.v1 import generate_pb2 as pb
    from tokenwire.v1 import generate_pb2_grpc as pb_grpc

    out = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        for text in prompts:
            body = {"inputs": text,
                    "parameters": {"max_new_tokens": GREEDY_TOKENS, "details": True}}
            reply = stub.Generate(json_format.ParseDict(body, pb.GenerateRequest()), timeout=120)
            out.append([t.id for t in reply.details.tokens])
    return out


# A shard's warm-up report (shard/server/loader.py): "rank0 ... warmup: kernel tuning: T shapes
# tuned, R read from the cache ...".
TUNING_LINE = re.compile(r"rank(\d+) .*warmup: kernel tuning: (\d+) shapes tuned, (\d+) read")


def _tuning_counts(log_path: Path) -> dict[int, tuple[int, int]]:
    """{rank: (shapes tuned, shapes read from the cache)} from a launch log."""
    return {int(m[1]): (int(m[2]), int(m[3])) for m in TUNING_LINE.finditer(log_path.read_text())}


def test_launch_num_shard_2_on_gpus_equals_one_shard(trained_model, tmp_path, tuning_dir, request):
    """The shipped path: `launch --num-shard 2` puts rank r on cuda:r (each shard's model thread
    bound to its GPU), the router drives both ranks; greedy output over the public gRPC API equals
    `--num-shard 1` on the trained tiny model (both deployments up at once). Start-up shares the
    tuning cache: the two ranks measure each shape once between them, and after the rank job and
    the one-GPU greedy run of this module (same shapes) neither deployment measures any."""
    from transformers import AutoTokenizer

    from shard.tools.tiny_training import TASK, task_continuation, task_prompt

    tokenizer = AutoTokenizer.from_pretrained(trained_model)

    def round_trips(ids: list[int]) -> bool:  # text that the router tokenizes back to `ids`
        return tokenizer(tokenizer.decode(ids[1:]))["input_ids"] == ids

    # Task prompts whose text tokenizes back exactly (BPE merges break some), one per length.
    ids = [next(p for stride in TASK.strides for start in range(TASK.modulus)
                if round_trips(p := task_prompt(length, stride, start))) for length in (17, 5, 45)]
    prompts = [tokenizer.decode(p[1:]) for p in ids]
    with (_launched(trained_model, 2, tmp_path, tuning_dir) as two,
          _launched(trained_model, 1, tmp_path, tuning_dir) as one):
        _wait_serving([two, one])
        two_tokens = _generate(two[0], prompts)
        one_tokens = _generate(one[0], prompts)
    assert two_tokens == one_tokens
    assert two_tokens == [task_continuation(p, GREEDY_TOKENS) for p in ids]
    tp2, tp1 = _tuning_counts(two[2]), _tuning_counts(one[2])
    print({"tp2 (tuned, read) per rank": tp2, "tp1": tp1})
    assert set(tp2) == {0, 1} and set(tp1) == {0}, (tp2, tp1)
    shapes = sum(tp2[0])  # every distinct decode-linear shape of a TP=2 rank
    assert shapes > 0 and sum(tp2[1]) == shapes
    assert tp2[0][0] + tp2[1][0] <= shapes  # no shape measured by both ranks
    if GREEDY in _selected(request):  # the rank job and the one-GPU run measured them all
        assert tp2[0][0] == tp2[1][0] == tp1[0][0] == 0, (tp2, tp1)
