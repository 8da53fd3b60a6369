"""LoRA adapters end to end: `tokenwire launch` (shard, router, Envoy) serving a tiny model with
adapters written by `peft`, one loaded at start-up (--lora-adapters) and others at run time over
gRPC and REST. Greedy tokens equal transformers + PeftModel (unmerged) per adapter; a batch
mixing the base model and 3 adapters equals each request alone; loading and unloading while 32
streams run drops no stream and changes no output; bad adapters fail the load call naming the
problem and the server stays healthy. One deployment serves the module."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tokenizers
from tokenwire.v1 import generate_pb2 as pb
from tokenwire.v1 import generate_pb2_grpc

from tests.helpers.http_api import http_json
from tests.helpers.lora import load_base, peft_greedy, write_adapter
from tests.helpers.metrics import scrape
from tests.helpers.models import tiny_model
from tests.helpers.processes import Deployment, launch

pytestmark = pytest.mark.slow

N = 10
PROMPT = "The quick brown fox jumps over the lazy dog while the router"
ADAPTERS = {  # name -> write_adapter options
    "start": dict(r=4, alpha=8.0, seed=11),
    "a1": dict(r=8, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=12,
               std=0.3),
    "a2": dict(r=2, alpha=4.0, targets=("gate_proj", "up_proj", "down_proj"), seed=13,
               std=0.3),
    "a3": dict(r=4, alpha=4.0, seed=14, use_rslora=True),
    "hot": dict(r=4, alpha=8.0, seed=15, std=0.25),
    "rest1": dict(r=2, alpha=4.0, seed=16, std=0.3),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = load_base(model_dir)
    out = {name: write_adapter(model_dir, root / name, base=base, **kw)
           for name, kw in ADAPTERS.items()}
    # Bad ones: rank above the limit, unsupported target, missing weights, wrong base shapes.
    out["rank16"] = write_adapter(model_dir, root / "rank16", base=base, r=16)
    out["head"] = write_adapter(model_dir, root / "head", base=base, r=2,
                                targets=("q_proj", "lm_head"))
    out["no_weights"] = root / "no_weights"
    out["no_weights"].mkdir()
    shutil.copy(out["start"] / "adapter_config.json", out["no_weights"])
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    config.hidden_size, config.intermediate_size = 32, 64
    other = transformers.AutoModelForCausalLM.from_config(config)
    out["wrong_base"] = write_adapter(model_dir, root / "wrong_base", base=other, r=2)
    return out


@pytest.fixture(scope="module")
def prompt_ids(model_dir) -> list[int]:
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return tok.encode(PROMPT).ids


@pytest.fixture(scope="module")
def reference(model_dir, adapters, prompt_ids) -> dict[str, list[int]]:
    """transformers + peft greedy tokens per adapter ("" = base)."""
    base = load_base(model_dir)
    out = {"": peft_greedy(model_dir, None, prompt_ids, N, base=base)}
    for name in ADAPTERS:
        out[name] = peft_greedy(model_dir, adapters[name], prompt_ids, N, base=base)
        assert out[name] != out[""], f"adapter {name} does not change the greedy output"
    return out


@pytest.fixture(scope="module")
def deployment(model_dir, adapters, tmp_path_factory) -> Iterator[Deployment]:
    dep = launch(
        tmp_path_factory.mktemp("lora"),
        "--model-id", str(model_dir),
        "--lora-adapters", f"start={adapters['start']}",
        "--max-loras", "4", "--max-lora-rank", "8",
        "--kv-cache-memory-mb", "64", "--max-concurrent-requests", "64",
        "--max-batch-size", "64",
    )  # fmt: skip
    yield dep
    code = dep.stop()
    assert code == 0, dep.log()


@pytest.fixture(scope="module")
def stub(deployment) -> Iterator[generate_pb2_grpc.TextGenerationStub]:
    with grpc.insecure_channel(deployment.target) as channel:
        yield generate_pb2_grpc.TextGenerationStub(channel)


def _request(adapter: str | None, n: int = N) -> pb.GenerateRequest:
    params = pb.GenerateParameters(max_new_tokens=n, details=True)
    if adapter is not None:
        params.adapter_id = adapter
    return pb.GenerateRequest(inputs=PROMPT, parameters=params)


def _tokens(reply: pb.GenerateResponse) -> list[int]:
    return [t.id for t in reply.details.tokens]


def _matches(got: list[int], want: list[int], finish_reason: str) -> bool:
    """tokenwire stops at EOS, the reference (EOS off) goes on: compare the common part."""
    if finish_reason == "length":
        return got == want
    return finish_reason == "eos_token" and got == want[: len(got)]


def _load(stub, *pairs: tuple[str, Path]) -> pb.LoadAdapterResponse:
    return stub.LoadAdapter(pb.LoadAdapterRequest(
        adapters=[pb.AdapterSource(name=n, path=str(p)) for n, p in pairs]), timeout=60)


def test_startup_adapter_matches_peft(stub, reference):
    info = stub.Info(pb.InfoRequest(), timeout=10)
    assert [a.name for a in info.adapters] == ["start"]
    assert info.max_loras == 4 and info.max_lora_rank == 8
    assert info.adapters[0].rank == 4 and len(info.adapters[0].target_modules) == 7
    for adapter in (None, "start"):
        reply = stub.Generate(_request(adapter), timeout=60)
        assert _matches(_tokens(reply), reference[adapter or ""], reply.details.finish_reason)


def test_mixed_batch_of_base_and_three_adapters(deployment, stub, adapters, reference):
    loaded = _load(stub, *((n, adapters[n]) for n in ("a1", "a2", "a3")))
    assert [a.name for a in loaded.adapters] == ["a1", "a2", "a3"]
    names = [None, "a1", "a2", "a3"]
    alone = {n: stub.Generate(_request(n), timeout=60) for n in names}

    async def together() -> list[pb.GenerateResponse]:
        async with grpc.aio.insecure_channel(deployment.target) as channel:
            s = generate_pb2_grpc.TextGenerationStub(channel)
            return await asyncio.gather(*(s.Generate(_request(n), timeout=60) for n in names))

    mixed = asyncio.run(together())
    for name, reply in zip(names, mixed):
        assert _tokens(reply) == _tokens(alone[name]), name
        assert _matches(_tokens(reply), reference[name or ""], reply.details.finish_reason), name


def test_hot_load_and_unload_while_32_streams_run(deployment, stub, adapters, reference):
    names = [None, "start", "a1", "a3"]  # a2 is unloaded untouched, a1 with streams in flight
    want = {n: _tokens(stub.Generate(_request(n, 40), timeout=60)) for n in names}

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(deployment.target) as channel:
            s = generate_pb2_grpc.TextGenerationStub(channel)

            async def stream(name: str | None) -> list[int]:
                out = []
                async for event in s.GenerateStream(_request(name, 40), timeout=120):
                    assert not event.HasField("error"), event.error
                    out.append(event.token.id)
                return out

            tasks = [asyncio.ensure_future(stream(names[i % 4])) for i in range(32)]
            await asyncio.sleep(0.3)  # the streams are running
            loaded = await s.LoadAdapter(pb.LoadAdapterRequest(adapters=[
                pb.AdapterSource(name="hot", path=str(adapters["hot"]))]), timeout=60)
            assert [a.name for a in loaded.adapters] == ["hot"]
            # Usable as soon as the call returns.
            reply = await s.Generate(_request("hot"), timeout=60)
            assert _matches(_tokens(reply), reference["hot"], reply.details.finish_reason)
            await s.UnloadAdapter(pb.UnloadAdapterRequest(name="a2"), timeout=60)
            # Unloading a1 waits for its streams; meanwhile new a1 requests are NOT_FOUND.
            unload = asyncio.ensure_future(
                s.UnloadAdapter(pb.UnloadAdapterRequest(name="a1"), timeout=120))
            await asyncio.sleep(0.05)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await s.Generate(_request("a1"), timeout=60)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            assert "adapter 'a1' is not loaded" in refused.value.details()
            results = await asyncio.gather(*tasks)
            await unload
            for i, got in enumerate(results):
                assert got == want[names[i % 4]], f"stream {i} ({names[i % 4]})"

    asyncio.run(scenario())
    listed = [a.name for a in stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10).adapters]
    assert "a1" not in listed and "a2" not in listed and "hot" in listed
    assert stub.Health(pb.HealthRequest(), timeout=10) is not None


@pytest.mark.parametrize(
    ("which", "code", "needles"),
    [
        ("rank16", grpc.StatusCode.INVALID_ARGUMENT, ["rank 16 exceeds --max-lora-rank 8"]),
        ("head", grpc.StatusCode.INVALID_ARGUMENT, ["target module 'lm_head'", "not supported"]),
        ("no_weights", grpc.StatusCode.INVALID_ARGUMENT, ["no adapter_model.safetensors"]),
        ("wrong_base", grpc.StatusCode.INVALID_ARGUMENT, ["has shape", "base model needs"]),
        ("missing", grpc.StatusCode.INVALID_ARGUMENT, ["not found"]),
        ("start", grpc.StatusCode.ALREADY_EXISTS, ["already loaded"]),
    ],
)
def test_bad_adapters_fail_the_load(stub, adapters, tmp_path, which, code, needles):
    path = adapters.get(which, tmp_path / "missing")
    name = "start" if which == "start" else f"bad-{which}"
    with pytest.raises(grpc.RpcError) as info:
        # All or nothing: a good adapter in the same call is not kept either.
        _load(stub, ("good-companion", adapters["rest1"]), (name, path))
    assert info.value.code() == code, info.value.details()
    for needle in needles:
        assert needle in info.value.details(), info.value.details()
    listed = [a.name for a in stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10).adapters]
    assert name not in listed or which == "start"
    assert "good-companion" not in listed
    stub.Health(pb.HealthRequest(), timeout=10)
    assert stub.Generate(_request("start", 2), timeout=60).details.generated_tokens >= 1


def test_rest_through_envoy(deployment, adapters, reference):
    port = deployment.http_port
    assert port is not None
    status, _, body = http_json(port, "POST", "/info/loras", {
        "adapters": [{"name": "rest1", "path": str(adapters["rest1"])}]})
    assert status == 200, body
    assert [a["name"] for a in body["adapters"]] == ["rest1"]
    status, _, info = http_json(port, "GET", "/info")
    assert status == 200 and "rest1" in [a["name"] for a in info["adapters"]]
    status, _, models = http_json(port, "GET", "/v1/models")
    by_id = {m["id"]: m for m in models["data"]}
    assert by_id["rest1"]["parent"] == info["model_id"] and "parent" not in by_id[info["model_id"]]
    status, _, body = http_json(port, "POST", "/generate", {
        "inputs": PROMPT, "parameters": {"max_new_tokens": N, "adapter_id": "rest1",
                                         "details": True}})
    assert status == 200, body
    got = [t["id"] for t in body["details"]["tokens"]]
    assert _matches(got, reference["rest1"], body["details"]["finish_reason"])
    status, _, body = http_json(port, "POST", "/v1/completions", {
        "model": "rest1", "prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert status == 200 and body["model"] == "rest1", body
    status, _, body = http_json(port, "POST", "/generate", {
        "inputs": PROMPT, "parameters": {"adapter_id": "nope"}})
    assert status == 404 and "adapter 'nope' is not loaded" in body["error"], body
    status, _, body = http_json(port, "POST", "/v1/completions", {
        "model": "nope", "prompt": PROMPT, "max_tokens": 3})
    assert status == 404 and "nope" in json.dumps(body), body
    status, _, body = http_json(port, "POST", "/info/loras", {
        "adapters": [{"name": "bad", "path": str(adapters["rank16"])}]})
    assert status == 422 and "exceeds --max-lora-rank" in body["error"], body
    status, _, body = http_json(port, "DELETE", "/info/loras/rest1")
    assert status == 200, body
    status, _, body = http_json(port, "DELETE", "/info/loras/rest1")
    assert status == 404, body
    status, _, body = http_json(port, "POST", "/generate", {
        "inputs": PROMPT, "parameters": {"adapter_id": "rest1"}})
    assert status == 404, body


def test_metrics_and_log_name_the_adapter(deployment, stub):
    stub.Generate(_request("start", 3), timeout=60)
    metrics = scrape(deployment.metrics_port)
    assert metrics.value("tokenwire_adapter_requests_total", adapter="start", status="ok") >= 1
    assert metrics.value("tokenwire_adapter_generated_tokens_total", adapter="start") >= 3
    # Names of no loaded adapter (test_rest_through_envoy's "nope") share one label value.
    assert metrics.total("tokenwire_adapter_requests_total", adapter="<unknown>") >= 1
    assert metrics.total("tokenwire_adapter_requests_total", adapter="nope") == 0
    assert 'adapter=start' in deployment.log()
