"""A LoRA adapter on the real model (SmolLM2-135M-Instruct, trained weights): written by `peft`
with random weights, loaded at start-up by `tokenwire shard --lora-adapters`, served by a real
router over gRPC; its greedy tokens equal transformers + PeftModel (unmerged), and differ from
the base model's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tokenwire.v1 import generate_pb2 as pb
from tokenwire.v1 import generate_pb2_grpc

from tests.helpers.lora import load_base, peft_greedy, write_adapter
from tests.helpers.processes import Deployment, start_deployment
from tests.helpers.smollm2 import snapshot

# The first test's setup may convert SmolLM2's GGUF (tests/helpers/smollm2.py: ~20-70 s quiet,
# 285 s measured on a 2-core host ~7x oversubscribed) before its launch (with a deadline of
# its own): the default 300 s a test would cut the setup short of that deadline.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

N = 8
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return snapshot(tmp_path_factory)


@pytest.fixture(scope="module")
def adapter(model_dir, tmp_path_factory) -> Path:
    return write_adapter(model_dir, tmp_path_factory.mktemp("smol") / "adapter", r=8, alpha=16,
                         targets=("q_proj", "v_proj", "o_proj", "down_proj"), seed=7, std=0.05)


@pytest.fixture(scope="module")
def deployment(model_dir, adapter, tmp_path_factory) -> Iterator[Deployment]:
    dep = start_deployment(
        model_dir, tmp_path_factory.mktemp("smol-lora"),
        router_args=["--max-total-tokens", "256", "--max-input-tokens", "128"],
        shard_args=["--dtype", "float32", "--kv-cache-memory-mb", "64",
                    "--lora-adapters", f"smol={adapter}", "--max-lora-rank", "8"],
        timeout=240.0,
    )  # fmt: skip
    yield dep
    dep.stop()


def test_smollm2_adapter_matches_peft(deployment, model_dir, adapter):
    with grpc.insecure_channel(deployment.target) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        ids = [t.id for t in stub.Tokenize(pb.TokenizeRequest(inputs=PROMPT), timeout=30).tokens]
        got = {}
        for name in (None, "smol"):
            params = pb.GenerateParameters(max_new_tokens=N, details=True)
            if name is not None:
                params.adapter_id = name
            reply = stub.Generate(pb.GenerateRequest(inputs=PROMPT, parameters=params),
                                  timeout=120)
            got[name] = [t.id for t in reply.details.tokens]
    base = load_base(model_dir)
    want_base = peft_greedy(model_dir, None, ids, N, base=base)
    want = peft_greedy(model_dir, adapter, ids, N, base=base)
    assert want != want_base  # the adapter changes the greedy output
    assert got[None] == want_base[: len(got[None])]
    assert got["smol"] == want[: len(got["smol"])] and len(got["smol"]) >= 4
