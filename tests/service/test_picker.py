"""The endpoint picker's parts without processes: prompts out of requests, the prefix index,
scoring, metric reading, and the ext_proc exchange over a real gRPC channel."""

from __future__ import annotations

import json
import random
import struct
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import grpc
import pytest
from google.api.httpbody_pb2 import HttpBody
from tokenwire.third_party import ext_proc_pb2 as xp
from tokenwire.third_party import ext_proc_pb2_grpc as xp_grpc
from tokenwire.v1 import generate_pb2, openai_pb2

import service.picker.replicas as replicas_module
from service.picker.picker import EndpointPicker, PickerConfig
from service.picker.prefix_index import PrefixIndex, prefix_keys
from service.picker.prompt import prompt_text
from service.picker.replicas import MetricNames, ReplicaSet, parse_backends, parse_load
from service.picker.scoring import Candidate, Weights, rank
from service.picker.server import (
    DESTINATION_HEADER,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    start_server,
)

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india")


def framed(message: bytes) -> bytes:
    return struct.pack(">BI", 0, len(message)) + message


def test_prompts_of_grpc_and_json_requests() -> None:
    gen = generate_pb2.GenerateRequest(inputs="Hello there").SerializeToString()
    assert prompt_text("/tokenwire.v1.TextGeneration/GenerateStream", framed(gen)) == "Hello there"
    chat = openai_pb2.ChatRequest(
        messages=[
            openai_pb2.ChatMessage(role="system", content="Be brief."),
            openai_pb2.ChatMessage(role="user", content="Hi"),
        ]
    ).SerializeToString()
    assert prompt_text("/tokenwire.v1.OpenAIService/Chat", framed(chat)) == (
        "system: Be brief.\nuser: Hi\n"
    )
    body = json.dumps(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            ]
        }
    )
    http = HttpBody(content_type="application/json", data=body.encode()).SerializeToString()
    assert prompt_text("/tokenwire.v1.OpenAIService/ChatCompletions", framed(http)) == (
        "system: Be brief.\nuser: Hi\n"
    )
    assert prompt_text("/v1/completions", b'{"prompt": "abc"}') == "abc"
    assert prompt_text("/generate?x=1", b'{"inputs": "abc"}') == "abc"
    # No prompt: other methods, broken or compressed bodies.
    assert prompt_text("/tokenwire.v1.TextGeneration/Info", framed(b"")) is None
    assert prompt_text("/tokenwire.v1.TextGeneration/Generate", b"\x00\x00") is None
    assert prompt_text("/tokenwire.v1.TextGeneration/Generate", b"\x01" + framed(gen)[1:]) is None
    assert prompt_text("/v1/completions", b"{not json") is None


def test_prefix_index_matches_leading_chunks_and_evicts_tails_first() -> None:
    a = prefix_keys("x" * 64 + "A" * 64 + "B" * 64, 64, 100)
    b = prefix_keys("x" * 64 + "A" * 64 + "C" * 64, 64, 100)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert prefix_keys("x" * 63, 64, 100) == []
    index = PrefixIndex()
    index.record(a, "r1")
    assert index.matched(b, "r1") == 2 and index.matched(a, "r1") == 3
    assert index.matched(a, "r2") == 0
    index.set_capacity("r1", 2)  # the tail of `a` goes first
    assert index.matched(a, "r1") == 2
    index.forget("r1")
    assert index.matched(a, "r1") == 0


def test_rank_prefers_affinity_within_the_balance_slack() -> None:
    w = Weights(prefix=3.0, queue=1.0, kv=1.0, balance_slack=4.0)
    cached = Candidate("a:1", load=3, kv_usage=0.5, matched_fraction=1.0)
    idle = Candidate("b:1", load=0, kv_usage=0.0, matched_fraction=0.0)
    assert rank([idle, cached], w) == ["a:1", "b:1"]
    overloaded = Candidate("a:1", load=10, kv_usage=0.5, matched_fraction=1.0)
    assert rank([idle, overloaded], w) == ["b:1", "a:1"]
    # No affinity anywhere: the least loaded, then the least picked.
    assert rank([Candidate("a:1", 2, 0.0, 0.0), Candidate("b:1", 1, 0.0, 0.0)], w) == ["b:1", "a:1"]
    assert (
        rank([Candidate("a:1", 0, 0.0, 0.0, picks=5), Candidate("b:1", 0, 0.0, 0.0, picks=2)], w)[0]
        == "b:1"
    )
    assert rank([], w) == []


METRICS = """\
# TYPE tokenwire_queue_size gauge
tokenwire_queue_size 3.0
# TYPE tokenwire_running_requests gauge
tokenwire_running_requests 5.0
# TYPE tokenwire_kv_cache_usage_ratio gauge
tokenwire_kv_cache_usage_ratio 0.25
# TYPE tokenwire_cache_config_info gauge
tokenwire_cache_config_info{block_size="16",num_gpu_blocks="128"} 1.0
# TYPE tokenwire_serving gauge
tokenwire_serving 1.0
"""


def test_replica_metrics_are_read_under_configurable_names() -> None:
    load = parse_load(METRICS, MetricNames())
    assert (load.waiting, load.running, load.kv_usage, load.serving) == (3, 5, 0.25, True)
    assert (load.block_size, load.num_blocks) == (16, 128)
    vllm = parse_load(
        "vllm:num_requests_waiting 2\nvllm:kv_cache_usage_perc 0.5\n",
        MetricNames(waiting="vllm:num_requests_waiting", kv_usage="vllm:kv_cache_usage_perc"),
    )
    assert (vllm.waiting, vllm.kv_usage, vllm.serving) == (2, 0.5, True)
    assert not parse_load(
        METRICS.replace("tokenwire_serving 1.0", "tokenwire_serving 0.0"), MetricNames()
    ).serving


def test_backends_parse_with_their_metrics_ports() -> None:
    backends = parse_backends("127.0.0.1:50051/9000, 10.0.0.2:50051", metrics_port=9100)
    assert [(b.address, b.metrics_url) for b in backends] == [
        ("127.0.0.1:50051", "http://127.0.0.1:9000/metrics"),
        ("10.0.0.2:50051", "http://10.0.0.2:9100/metrics"),
    ]
    for bad in ("nohost", "h:p", "h:1/x", ""):
        with pytest.raises(ValueError, match="--backends"):
            parse_backends(bad, metrics_port=9000)
    with pytest.raises(ValueError, match="metrics port"):
        parse_backends("h:1", metrics_port=None)


async def _replica_set(texts: dict[str, str]) -> ReplicaSet:
    async def fetch(url: str) -> str:
        text = texts[url]
        if text == "down":
            raise OSError("refused")
        return text

    backends = parse_backends(",".join(f"127.0.0.{i}:5000/9000" for i in (1, 2, 3)), None)
    replicas = ReplicaSet(backends, MetricNames(), fetch=fetch)
    await replicas.poll_once()
    return replicas


async def test_picker_keeps_a_prefix_on_one_replica_and_spreads_new_ones() -> None:
    idle = METRICS.replace("3.0", "0.0").replace("5.0", "0.0")
    urls = {f"http://127.0.0.{i}:9000/metrics": idle for i in (1, 2, 3)}
    picker = EndpointPicker(await _replica_set(urls), PickerConfig(chunk_chars=16))
    prompts = [f"system prompt number {i} " * 8 for i in range(3)]
    first = [picker.pick(p)[0] for p in prompts]
    assert len(set(first)) == 3  # new prefixes spread over the replicas
    for _ in range(5):
        for p, where in zip(prompts, first, strict=True):
            assert picker.pick(p + "a different question")[0] == where
    order = picker.pick(None)
    assert sorted(order) == sorted(first)  # every ready replica, as fallbacks
    assert picker.pick(prompts[0], subset={first[1]}) == [first[1]]


async def test_picker_leaves_out_replicas_not_serving_or_unreachable() -> None:
    urls = {
        "http://127.0.0.1:9000/metrics": METRICS,
        "http://127.0.0.2:9000/metrics": METRICS.replace(
            "tokenwire_serving 1.0", "tokenwire_serving 0.0"
        ),
        "http://127.0.0.3:9000/metrics": "down",
    }
    picker = EndpointPicker(await _replica_set(urls))
    assert picker.pick("anything") == ["127.0.0.1:5000"]


async def test_ext_proc_exchange_sets_the_destination_header_and_metadata() -> None:
    urls = {f"http://127.0.0.{i}:9000/metrics": METRICS for i in (1, 2, 3)}
    picker = EndpointPicker(await _replica_set(urls))
    server, port, _ = await start_server(picker, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = xp_grpc.ExternalProcessorStub(channel)
            path = xp.HeaderValue(key=":path", raw_value=b"/tokenwire.v1.TextGeneration/Generate")
            body = framed(generate_pb2.GenerateRequest(inputs="hi " * 50).SerializeToString())
            requests = [
                xp.ProcessingRequest(
                    request_headers=xp.HttpHeaders(headers=xp.HeaderMap(headers=[path]))
                ),
                xp.ProcessingRequest(request_body=xp.HttpBody(body=body, end_of_stream=True)),
            ]
            replies = [r async for r in stub.Process(iter(requests))]
        assert replies[0].WhichOneof("response") == "request_headers"
        assert not replies[0].request_headers.response.header_mutation.set_headers
        mutation = replies[1].request_body.response.header_mutation.set_headers[0]
        assert mutation.header.key == DESTINATION_HEADER
        endpoints = mutation.header.raw_value.decode().split(",")
        assert sorted(endpoints) == ["127.0.0.1:5000", "127.0.0.2:5000", "127.0.0.3:5000"]
        meta = replies[1].dynamic_metadata.fields["envoy.lb"].struct_value
        assert meta.fields[DESTINATION_HEADER].string_value == ",".join(endpoints)
    finally:
        await server.stop(0)


async def test_ext_proc_without_a_ready_replica() -> None:
    """No replica ready by its metrics: the picker names none (Envoy's balancing and health
    checks decide); with GIE's subset hint naming none ready: an immediate 503."""
    urls = {f"http://127.0.0.{i}:9000/metrics": "down" for i in (1, 2, 3)}
    picker = EndpointPicker(await _replica_set(urls))
    server, port, _ = await start_server(picker, "127.0.0.1", 0)
    headers = xp.HttpHeaders(
        headers=xp.HeaderMap(headers=[xp.HeaderValue(key=":path", value="/x")]),
        end_of_stream=True,
    )
    hint = xp.Metadata()
    subset = hint.filter_metadata[SUBSET_NAMESPACE].get_or_create_list(SUBSET_KEY)
    subset.append("127.0.0.1:5000")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = xp_grpc.ExternalProcessorStub(channel)
            plain = [
                r async for r in stub.Process(iter([xp.ProcessingRequest(request_headers=headers)]))
            ]
            hinted = [
                r
                async for r in stub.Process(
                    iter([xp.ProcessingRequest(request_headers=headers, metadata_context=hint)])
                )
            ]
        assert plain[0].WhichOneof("response") == "request_headers"
        assert not plain[0].request_headers.response.header_mutation.set_headers
        immediate = hinted[0].immediate_response
        assert (immediate.status.code, immediate.grpc_status.status) == (503, 14)
    finally:
        await server.stop(0)


def test_rank_takes_affinity_from_a_replica_with_too_large_a_share() -> None:
    w = Weights()  # max_share 1.5, counted once the mean share is 50 picks or more
    hot = Candidate("a:1", load=1, kv_usage=0.0, matched_fraction=1.0, share=120.0)
    others = [Candidate(f"{x}:1", 1, 0.0, 0.0, share=40.0) for x in "bc"]
    assert rank([hot, *others], w)[0] != "a:1"
    # Within the allowed share the prefix stays where it is cached.
    warm = Candidate("a:1", load=1, kv_usage=0.0, matched_fraction=1.0, share=80.0)
    assert rank([warm, *others], w)[0] == "a:1"
    # Few picks say nothing: a share of 3x the mean over 30 picks is noise, not a hot spot.
    few = [Candidate("a:1", 1, 0.0, 1.0, share=18.0)] + [
        Candidate(f"{x}:1", 1, 0.0, 0.0, share=6.0) for x in "bc"
    ]
    assert rank(few, w)[0] == "a:1"


def test_rank_outvotes_load_and_kv_noise_with_a_cached_prefix() -> None:
    """A fully cached prompt goes home even when that replica looks the busiest and the fullest
    by every other term (queue, KV, cache contents) while within the guards."""
    home = Candidate("a:1", load=9, kv_usage=1.0, matched_fraction=1.0, share=10.0, cached=90)
    idle = Candidate("b:1", load=0, kv_usage=0.0, matched_fraction=0.0, share=10.0, cached=0)
    assert rank([idle, home], Weights(), chunks=8)[0] == "a:1"


def test_new_prefixes_go_to_the_emptier_cache_despite_instantaneous_noise() -> None:
    """A new prompt goes where the prefix index holds the least prompt text, even if that
    replica happens to be the busier one right now."""
    full = Candidate("a:1", load=1, kv_usage=0.0, matched_fraction=0.0, cached=24)
    emptier = Candidate("b:1", load=3, kv_usage=0.3, matched_fraction=0.0, cached=16)
    assert rank([full, emptier], Weights(), chunks=8)[0] == "b:1"
    # Caches holding about as much: the queue decides.
    assert rank([replace(full, cached=16), emptier], Weights(), chunks=8)[0] == "a:1"


async def test_shared_system_prompts_get_one_home_each_spread_evenly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The acceptance workload without processes: 400 requests over 8 long shared system prompts
    and 3 idle replicas, one every 10 ms (as fast as the e2e test sends them). Every prompt keeps
    one replica from its first request on, the replicas get 3, 3 and 2 prompts, and none gets
    more than 1.5x its share of the requests."""
    clock = [0.0]
    monkeypatch.setattr(replicas_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    idle = METRICS.replace("3.0", "0.0").replace("5.0", "0.0")
    urls = {f"http://127.0.0.{i}:9000/metrics": idle for i in (1, 2, 3)}
    for seed in range(5):
        picker = EndpointPicker(await _replica_set(urls))
        rng = random.Random(seed)
        prompts = [
            f"System {i}: " + " ".join(rng.choice(WORDS) for _ in range(80)) + "\n"
            for i in range(8)
        ]
        homes: dict[int, set[str]] = {i: set() for i in range(8)}
        shares: Counter[str] = Counter()
        for k in range(400):
            clock[0] += 0.01
            i = rng.randrange(8)
            where = picker.pick(prompts[i] + f"Question {k}: {rng.choice(WORDS)}?")[0]
            homes[i].add(where)
            shares[where] += 1
        assert all(len(h) == 1 for h in homes.values()), (seed, homes)
        per_replica = Counter(next(iter(h)) for h in homes.values())
        assert sorted(per_replica.values()) == [2, 3, 3], (seed, per_replica)
        assert max(shares.values()) <= 1.5 * 400 / 3, (seed, shares)


async def test_a_spilled_request_leaves_its_prefix_at_home() -> None:
    """While a prompt's replica is clearly overloaded its requests go elsewhere, but the prefix
    keeps its home: once the imbalance is gone the prompt goes back there."""
    idle = METRICS.replace("3.0", "0.0").replace("5.0", "0.0")
    urls = {f"http://127.0.0.{i}:9000/metrics": idle for i in (1, 2, 3)}
    replicas = await _replica_set(urls)
    picker = EndpointPicker(replicas, PickerConfig(weights=Weights(balance_slack=4.0)))
    prompt = "a shared system prompt " * 20
    home = picker.pick(prompt + "first")[0]
    busy = next(r for r in replicas.replicas if r.endpoint == home)
    loaded = busy.load
    busy.load = replace(loaded, waiting=20.0)  # its next scrape: a long queue
    spilled = picker.pick(prompt + "second")[0]
    assert spilled != home
    busy.load = loaded
    assert picker.pick(prompt + "third")[0] == home
    assert picker.index.matched(prefix_keys(prompt, 64, 512), spilled) == 0
