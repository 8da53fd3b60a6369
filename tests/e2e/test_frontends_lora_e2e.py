"""Run-time LoRA admin with `tokenwire router --frontends 2` against a real `tokenwire shard`
(tiny llama, adapters written by peft): a LoadAdapter / UnloadAdapter call reaching any front end
runs on the scheduler process's engine, and when it returns EVERY front end already serves the
new adapter set (Info, ListAdapters, OpenAI ListModels and `model` validation, requests naming
the adapter); errors keep their codes and messages. Clients use two connections pinned to each
front end (each front end's metrics port shows its calls, which identifies it); the
scheduler process's metrics port says the replica is serving (what `launch --replicas`'s endpoint
picker reads), with the front ends' request metrics summed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tokenwire.v1 import generate_pb2 as pb
from tokenwire.v1 import generate_pb2_grpc, openai_pb2, openai_pb2_grpc

from tests.helpers.lora import load_base, write_adapter
from tests.helpers.metrics import scrape, scrape_when_up
from tests.helpers.models import tiny_model
from tests.helpers.processes import Deployment, start_deployment

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPT = "The quick brown fox jumps over the lazy dog while the router"
CONNECTIONS_PER_FRONT_END = 2
MAX_CONNECTIONS = 64


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    model_dir = tiny_model(tmp_path_factory, "llama")
    root = tmp_path_factory.mktemp("fe-adapters")
    base = load_base(model_dir)
    out = {
        "hot": write_adapter(model_dir, root / "hot", base=base, r=4, alpha=8.0, seed=15, std=0.3),
        "rank16": write_adapter(model_dir, root / "rank16", base=base, r=16),
    }
    return model_dir, out


@pytest.fixture(scope="module")
def deployment(
    adapters: tuple[Path, dict[str, Path]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    model_dir, _ = adapters
    dep = start_deployment(
        model_dir,
        tmp_path_factory.mktemp("fe-lora"),
        router_args=["--frontends", "2", "--max-concurrent-requests", "16"],
        shard_args=["--max-loras", "2", "--max-lora-rank", "8", "--kv-cache-memory-mb", "32"],
    )
    yield dep
    dep.stop()


@pytest.fixture(scope="module")
def channels(deployment: Deployment) -> Iterator[list[grpc.Channel]]:
    """Connections pinned to known front ends: [A, B, A, B] (A, B = the two front ends).

    The kernel picks a front end per connection (SO_REUSEPORT hashes the 4-tuple), so nothing
    guarantees that 8 connections reach both: a loaded CI run once put all of them on one. Each new
    connection is identified instead by the front-end metrics port whose request count its first
    call raises, and connections are opened until both front ends hold two (64 at most: all 64 on
    one front end would be a broken spread, not luck)."""
    ports = [deployment.metrics_port + i for i in (1, 2)]
    opts = [("grpc.use_local_subchannel_pool", 1)]  # one TCP connection per channel
    by_front_end: list[list[grpc.Channel]] = [[], []]
    for _ in range(MAX_CONNECTIONS):
        if all(len(held) >= CONNECTIONS_PER_FRONT_END for held in by_front_end):
            break
        chan = grpc.insecure_channel(deployment.target, options=opts)
        grpc.channel_ready_future(chan).result(timeout=60)
        index = _front_end_of(chan, ports)
        if len(by_front_end[index]) < CONNECTIONS_PER_FRONT_END:
            by_front_end[index].append(chan)
        else:
            chan.close()
    assert all(len(held) == CONNECTIONS_PER_FRONT_END for held in by_front_end), (
        f"{MAX_CONNECTIONS} connections reached the front ends {[len(h) for h in by_front_end]}"
    )
    chans = [chan for pair in zip(*by_front_end, strict=True) for chan in pair]
    yield chans
    for c in chans:
        c.close()


def _front_end_of(chan: grpc.Channel, ports: list[int]) -> int:
    """Which front end serves `chan`: the one whose admitted-request count a call raises (counted
    at admission, before the reply is sent)."""
    before = [scrape_when_up(port).total("tokenwire_request_count_total") for port in ports]
    _generate(chan, None)
    after = [scrape_when_up(port).total("tokenwire_request_count_total") for port in ports]
    raised = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]
    assert len(raised) == 1, (before, after)
    return raised[0]


def _generate(chan: grpc.Channel, adapter: str | None) -> list[int]:
    params = pb.GenerateParameters(max_new_tokens=6, details=True)
    if adapter is not None:
        params.adapter_id = adapter
    stub = generate_pb2_grpc.TextGenerationStub(chan)
    reply = stub.Generate(pb.GenerateRequest(inputs=PROMPT, parameters=params), timeout=60)
    return [t.id for t in reply.details.tokens]


def _everywhere_listed(
    channels: list[grpc.Channel],
) -> list[tuple[list[str], list[str], list[str]]]:
    """(Info adapters, ListAdapters, OpenAI model ids) as each connection's front end sees them."""
    seen = []
    for chan in channels:
        stub = generate_pb2_grpc.TextGenerationStub(chan)
        info = [a.name for a in stub.Info(pb.InfoRequest(), timeout=10).adapters]
        listed = [a.name for a in stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10).adapters]
        models = openai_pb2_grpc.OpenAIServiceStub(chan).ListModels(
            openai_pb2.ListModelsRequest(), timeout=10
        )
        seen.append((info, listed, [m.id for m in models.data]))
    return seen


def _completion(chan: grpc.Channel, model: str) -> openai_pb2.CompletionResponse:
    stub = openai_pb2_grpc.OpenAIServiceStub(chan)
    return stub.Completion(
        openai_pb2.CompletionRequest(model=model, prompt=PROMPT, max_tokens=3, temperature=0.0),
        timeout=60,
    )


def test_admin_calls_reach_every_front_end(
    deployment: Deployment, channels: list[grpc.Channel], adapters: tuple[Path, dict[str, Path]]
) -> None:
    _, paths = adapters
    base = _generate(channels[0], None)
    for info, listed, models in _everywhere_listed(channels):
        assert (info, listed) == ([], []) and "hot" not in models

    # Loaded through connection 0: on return, every front end lists it and serves it.
    stub0 = generate_pb2_grpc.TextGenerationStub(channels[0])
    loaded = stub0.LoadAdapter(
        pb.LoadAdapterRequest(adapters=[pb.AdapterSource(name="hot", path=str(paths["hot"]))]),
        timeout=60,
    )
    assert [a.name for a in loaded.adapters] == ["hot"]
    for info, listed, models in _everywhere_listed(channels):
        assert info == ["hot"] and listed == ["hot"] and "hot" in models
    outputs = [_generate(chan, "hot") for chan in channels]
    assert all(o == outputs[0] for o in outputs) and outputs[0] != base
    for chan in channels:  # the OpenAI `model` check of every front end knows it
        assert _completion(chan, "hot").model == "hot"

    # Errors forwarded with their codes: a duplicate, a rank above the limit, an unknown name.
    for request, code, needle in [
        (pb.LoadAdapterRequest(adapters=[pb.AdapterSource(name="hot", path=str(paths["hot"]))]),
         grpc.StatusCode.ALREADY_EXISTS, "already loaded"),
        (pb.LoadAdapterRequest(adapters=[pb.AdapterSource(name="r16", path=str(paths["rank16"]))]),
         grpc.StatusCode.INVALID_ARGUMENT, "exceeds --max-lora-rank 8"),
    ]:  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            generate_pb2_grpc.TextGenerationStub(channels[1]).LoadAdapter(request, timeout=60)
        assert err.value.code() == code and needle in err.value.details(), err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub0.UnloadAdapter(pb.UnloadAdapterRequest(name="nope"), timeout=60)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()

    # Both front ends counted "hot" requests; the scheduler process's port sums them.
    ports = [deployment.metrics_port + i for i in (1, 2)]
    per_front_end = [scrape(port).total("tokenwire_adapter_requests_total", adapter="hot")
                     for port in ports]  # fmt: skip
    assert all(n > 0 for n in per_front_end), per_front_end
    merged = scrape(deployment.metrics_port)
    assert merged.total("tokenwire_adapter_requests_total", adapter="hot") == sum(per_front_end)

    # Unloaded through the last connection: on return, no front end lists or admits it.
    generate_pb2_grpc.TextGenerationStub(channels[-1]).UnloadAdapter(
        pb.UnloadAdapterRequest(name="hot"), timeout=60
    )
    for info, listed, models in _everywhere_listed(channels):
        assert (info, listed) == ([], []) and "hot" not in models
    for chan in channels:
        with pytest.raises(grpc.RpcError) as err:
            _generate(chan, "hot")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as err:
            _completion(chan, "hot")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()

    # Every front end dropped the unloaded adapter's series, not only the one the unload came
    # through; the requests naming it since are counted under "<unknown>".
    for scraped in [scrape(port) for port in ports] + [scrape(deployment.metrics_port)]:
        hot = [key for key in scraped.samples if ("adapter", "hot") in key[1]]
        assert hot == [], hot
        assert scraped.total("tokenwire_adapter_requests_total", adapter="<unknown>") > 0

    # Both front ends answered some of these calls (the connections are pinned to both).
    counts = [scrape(port).total("tokenwire_request_count_total") for port in ports]
    assert all(c > 0 for c in counts), counts
    # The scheduler process's port reports the replica serving (an endpoint picker reads it)
    # and the front ends' request metrics summed: one scrape sees the whole router.
    merged = scrape(deployment.metrics_port)
    assert merged["tokenwire_serving"] == 1.0
    assert merged.total("tokenwire_request_count_total") == sum(counts)
    assert merged["tokenwire_kv_blocks_total"] > 0  # the engine's, once
    assert "front ends: 2 (--frontends 2" in deployment.router.log()
