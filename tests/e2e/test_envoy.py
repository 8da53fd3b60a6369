"""End to end through the real Envoy binary: REST + SSE transcoding and gRPC pass-through in front
of a real `tokenwire launch` (router + shard, embedded tiny model, CPU)."""

from __future__ import annotations

import json
import math
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenwire.v1 import generate_pb2 as pb
from tokenwire.v1 import generate_pb2_grpc as pb_grpc

from service.app.gateway import Gateway, GatewaySettings
from tests.helpers.http_api import expect_error_status, http_json, sse_events
from tests.helpers.metrics import scrape
from tests.helpers.ports import free_port
from tests.helpers.processes import REPO, Deployment, launch
from tests.helpers.proto_json import to_json
from tests.helpers.tools import require
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow

MAX_CONCURRENT = 4


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    dep = launch(
        tmp_path_factory.mktemp("envoy"),
        "--max-concurrent-requests",
        str(MAX_CONCURRENT),
        "--max-request-bytes",
        "65536",
    )
    yield dep
    code = dep.stop()
    assert code == 0, dep.log()


def tgi_to_proto_json(value: object) -> object:
    """TGI's JSON and proto3 JSON of the same message made comparable: `null`s and empty lists
    left out (TGI skips some empty lists, proto JSON prints them all), the stream's 1-based
    `index` made 0-based (apply to TGI's side only)."""
    if isinstance(value, dict):
        out = {k: tgi_to_proto_json(v) for k, v in value.items() if v is not None and v != []}
        if "index" in out and "token" in out:
            out["index"] -= 1
        return out
    if isinstance(value, list):
        return [tgi_to_proto_json(v) for v in value]
    return value


def assert_json_close(a: object, b: object, path: str = "") -> None:
    """Equal JSON, floats compared as float32 (Envoy and Python print them differently)."""
    if isinstance(a, float) or isinstance(b, float):
        assert math.isclose(float(a), float(b), rel_tol=1e-5, abs_tol=1e-6), path
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), (path, a.keys(), b.keys())
        for key in a:
            assert_json_close(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_json_close(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


GREEDY = {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 12, "details": True}}


def test_tgi_readme_curl(deployment: Deployment) -> None:
    out = subprocess.run(
        [
            "curl",
            "-sS",
            f"127.0.0.1:{deployment.http_port}/generate",
            "-X",
            "POST",
            "-d",
            '{"inputs":"Testing API","parameters":{"max_new_tokens":9}}',
            "-H",
            "Content-Type: application/json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    body = json.loads(out.stdout)
    assert isinstance(body["generated_text"], str)
    assert set(body) == {"generated_text"}  # no details unless asked, as in TGI


def test_rest_generate_equals_grpc(deployment: Deployment) -> None:
    status, headers, body = http_json(deployment.http_port, "POST", "/generate", GREEDY)
    assert status == 200, body
    assert headers["content-type"] == "application/json"
    with grpc.insecure_channel(deployment.target) as channel:
        reply = pb_grpc.TextGenerationStub(channel).Generate(
            json_format.ParseDict(GREEDY, pb.GenerateRequest()), timeout=60
        )
    assert_json_close(tgi_to_proto_json(body), tgi_to_proto_json(to_json(reply)))
    details = body["details"]
    tokens = details["tokens"]
    assert all(set(t) == {"id", "text", "logprob", "special"} for t in tokens)
    # JSON booleans (always printed, as TGI does), and the text is the non-special tokens' texts.
    assert all(type(t["special"]) is bool for t in tokens), tokens
    assert body["generated_text"] == "".join(t["text"] for t in tokens if not t["special"])
    assert len(tokens) == details["generated_tokens"] > 0
    if details["finish_reason"] == "length":
        assert len(tokens) == GREEDY["parameters"]["max_new_tokens"]
    else:
        assert details["finish_reason"] == "eos_token" and tokens[-1]["special"] is True


def test_sse_equals_grpc_stream(deployment: Deployment) -> None:
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 24, "details": True}}
    events = list(sse_events(deployment.http_port, body))
    with grpc.insecure_channel(deployment.target) as channel:
        stream = pb_grpc.TextGenerationStub(channel).GenerateStream(
            json_format.ParseDict(body, pb.GenerateRequest()), timeout=60
        )
        expected = [to_json(m) for m in stream]
    assert len(events) == len(expected) > 1
    for (_, got), want in zip(events, expected):
        want = {k: v for k, v in want.items() if v != []}
        if isinstance(want.get("details"), dict):
            want["details"] = {k: v for k, v in want["details"].items() if v != []}
        assert_json_close(tgi_to_proto_json(got), want)
    # TGI's event shape: token{id,text,logprob,special}; generated_text and details null but last.
    for _, event in events[:-1]:
        assert set(event["token"]) == {"id", "text", "logprob", "special"}
        assert event["generated_text"] is None and event["details"] is None
    last = events[-1][1]
    assert last["details"]["finish_reason"] in ("length", "eos_token")
    assert last["generated_text"] == "".join(
        e["token"]["text"] for _, e in events if not e["token"]["special"]
    )


def test_sse_coalesce_tokens_option(deployment: Deployment) -> None:
    """`parameters.coalesce_tokens` through Envoy: every SSE event lists its tokens under
    `coalesced` (index = its last token's position); without the option no event has the key."""
    params = {"max_new_tokens": 24, "details": True}
    plain = [
        e for _, e in sse_events(deployment.http_port, {"inputs": "Once", "parameters": params})
    ]
    assert all("coalesced" not in e for e in plain)
    body = {"inputs": "Once", "parameters": {**params, "coalesce_tokens": True}}
    events = [e for _, e in sse_events(deployment.http_port, body)]
    tokens = [t for e in events for t in e["coalesced"]["tokens"]]
    assert [t["id"] for t in tokens] == [e["token"]["id"] for e in plain]
    position = 0  # TGI's stream index counts from 1
    for e in events:
        position += len(e["coalesced"]["tokens"])
        assert e["index"] == position and e["token"] == e["coalesced"]["tokens"][-1]
    text = "".join(t["text"] for t in tokens if not t["special"])
    assert text == events[-1]["generated_text"] == plain[-1]["generated_text"]


def test_sse_events_arrive_spread_over_the_generation(deployment: Deployment) -> None:
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 160}}
    start = time.monotonic()
    times = [t for t, _ in sse_events(deployment.http_port, body)]
    assert len(times) > 20
    span = times[-1] - start
    # Flushed one by one as generated: the first event arrives long before the last, and the
    # median event arrives well before the end (one burst at the end would put both at ~100%).
    assert times[0] - start < 0.5 * span, (times[0] - start, span)
    median = times[len(times) // 2] - start
    assert median < 0.85 * span, (median, span)
    distinct = len({round(t, 3) for t in times})
    assert distinct > len(times) // 4, distinct


def test_failure_after_first_event_is_in_band(deployment: Deployment) -> None:
    # A deadline (grpc-timeout travels through Envoy as a header) that passes mid-stream: the
    # HTTP/1.1 SSE client never sees trailers, so the router's last event carries the error.
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 1000}}
    events = [
        e for _, e in sse_events(deployment.http_port, body, headers={"grpc-timeout": "400m"})
    ]
    assert len(events) > 1
    last = events[-1]
    # The router gives up a little before the gRPC deadline (service/convert.py DEADLINE_SLACK_S)
    # so that this event still goes out before grpc cancels the call.
    # TGI's in-band error event: {"error", "error_type"}; a request that ran out of time is a
    # failed generation to TGI's clients.
    assert last.get("error_type") == "generation" and "deadline" in last["error"], last
    assert "token" not in last and "generated_text" not in last


def test_info_and_health(deployment: Deployment) -> None:
    status, _, info = http_json(deployment.http_port, "GET", "/info")
    assert status == 200, info
    assert info["max_concurrent_requests"] == MAX_CONCURRENT
    assert info["model_id"]
    assert http_json(deployment.http_port, "GET", "/health")[0] == 200
    status, _, body = http_json(deployment.http_port, "GET", "/nope")
    assert status == 404 and body["error_type"] == "not_found"


@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
@pytest.mark.parametrize(
    ("parameters", "field"),
    [
        ({"inputs": ""}, "inputs"),
        ({"inputs": "x", "parameters": {"temperature": -1.0}}, "temperature"),
        ({"inputs": "x", "parameters": {"top_p": 1.5}}, "top_p"),
        ({"inputs": "x", "parameters": {"max_new_tokens": 100000}}, "max_new_tokens"),
    ],
)
def test_invalid_input_is_422_naming_the_field(
    deployment: Deployment, parameters: dict, field: str, path: str
) -> None:
    if path == "/generate_stream":  # TGI's in-band error event, status 200
        events = [e for _, e in sse_events(deployment.http_port, parameters)]
        assert events == [{"error": events[0]["error"], "error_type": "validation"}], events
        assert field in events[0]["error"]
        return
    status, headers, body = http_json(deployment.http_port, "POST", path, parameters)
    assert body["error_type"] == "validation" and field in body["error"], body
    expect_error_status(path, status, body, 422)
    assert headers["content-type"] == "application/json"


def test_malformed_json_is_422_json(deployment: Deployment) -> None:
    status, headers, body = http_json(deployment.http_port, "POST", "/generate", raw=b'{"inputs":')
    assert status == 422 and headers["content-type"] == "application/json"
    assert body["error_type"] == "validation" and body["error"]


def test_oversized_body_is_413(deployment: Deployment) -> None:
    big = {"inputs": "a" * 100_000}
    for path in ("/generate", "/generate_stream"):
        status, _, body = http_json(deployment.http_port, "POST", path, big)
        assert status == 413, body
        assert body["error_type"] == "validation"


def test_over_capacity_is_429(deployment: Deployment) -> None:
    body = {"inputs": "The router batches", "parameters": {"max_new_tokens": 200}}
    results: list[int] = []
    lock = threading.Lock()

    def one() -> None:
        status, _, reply = http_json(deployment.http_port, "POST", "/generate", body)
        with lock:
            results.append(status)
        if status == 429:
            assert reply["error_type"] == "overloaded", reply

    threads = [threading.Thread(target=one) for _ in range(3 * MAX_CONCURRENT)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results.count(429) >= 1, results
    assert results.count(200) >= 1, results
    assert set(results) <= {200, 429}, results


def test_disconnect_mid_sse_frees_kv_blocks(deployment: Deployment) -> None:
    before = scrape(deployment.metrics_port)
    # 1000 tokens: a disconnect that did not cancel would keep the engine stepping ~1000 times.
    body = {"inputs": "Paged attention keeps keys", "parameters": {"max_new_tokens": 1000}}
    events = list(sse_events(deployment.http_port, body, limit=3))
    assert len(events) == 3
    wait_until(
        lambda: (
            (m := scrape(deployment.metrics_port))["tokenwire_kv_blocks_used"]
            <= before["tokenwire_kv_blocks_used"]
            and m["tokenwire_running_requests"] == 0
        ),
        timeout=15,
        interval=0.1,
        what="the disconnected stream's KV blocks freed",
    )
    after = scrape(deployment.metrics_port)
    assert (
        after["tokenwire_requests_aborted_total"] - before["tokenwire_requests_aborted_total"] == 1
    )
    assert (
        after.total("tokenwire_request_failure_total", method="generate_stream", reason="cancelled")
        - before.total(
            "tokenwire_request_failure_total", method="generate_stream", reason="cancelled"
        )
        == 1
    )
    # The engine stopped stepping it: a few steps past the 3 events read, not ~1000.
    steps = after["tokenwire_engine_steps_total"] - before["tokenwire_engine_steps_total"]
    assert steps < 200, steps


def test_grpc_clients_through_envoy(deployment: Deployment) -> None:
    request = json_format.ParseDict(GREEDY, pb.GenerateRequest())
    with (
        grpc.insecure_channel(deployment.target) as direct,
        grpc.insecure_channel(deployment.envoy_target) as via_envoy,
    ):
        want = pb_grpc.TextGenerationStub(direct).Generate(request, timeout=60)
        got = pb_grpc.TextGenerationStub(via_envoy).Generate(request, timeout=60)
        assert got == want
        stream = list(pb_grpc.TextGenerationStub(via_envoy).GenerateStream(request, timeout=60))
        assert stream[-1].generated_text == want.generated_text
        health = health_pb2_grpc.HealthStub(via_envoy).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.TextGenerationStub(via_envoy).Generate(
                pb.GenerateRequest(inputs=""), timeout=60
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_buf_curl_reflection_through_envoy(deployment: Deployment) -> None:
    buf = REPO / "node_modules/.bin/buf"
    require(buf.exists(), "buf not installed (npm ci)")
    base = ["--protocol", "grpc", "--http2-prior-knowledge"]
    out = subprocess.run(
        [str(buf), "curl", *base, "--list-services", f"http://{deployment.envoy_target}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    services = set(out.stdout.split())
    assert {"tokenwire.v1.TextGeneration", "grpc.health.v1.Health"} <= services, out.stdout
    out = subprocess.run(
        [
            str(buf),
            "curl",
            *base,
            "-d",
            '{"inputs":"Testing API","parameters":{"max_new_tokens":3}}',
            f"http://{deployment.envoy_target}/tokenwire.v1.TextGeneration/Generate",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "generatedText" in out.stdout


def test_router_down_is_503(tmp_path: Path) -> None:
    # A real Envoy from the same envoy.yaml whose router is not running.
    gateway = Gateway(
        GatewaySettings(http_port=free_port(), http_host="127.0.0.1", router_port=free_port())
    )
    gateway.start()
    try:
        gateway.wait_ready(30)
        for method, path, body in (
            ("POST", "/generate", {"inputs": "x"}),
            ("POST", "/generate_stream", {"inputs": "x"}),
            ("GET", "/health", None),
        ):
            status, headers, reply = http_json(gateway.settings.http_port, method, path, body)
            assert status == 503, reply
            assert headers["content-type"] == "application/json"
            assert reply["error_type"] == "unavailable", reply
        with grpc.insecure_channel(f"127.0.0.1:{gateway.settings.http_port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.TextGenerationStub(channel).Generate(
                    pb.GenerateRequest(inputs="x"), timeout=10
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        gateway.stop()


def test_envoy_yaml_is_valid_as_it_is() -> None:
    # Users run `envoy -c envoy/envoy.yaml` from the repository root, unchanged.
    from service.app.gateway import envoy_binary

    result = subprocess.run(
        [
            str(envoy_binary()),
            "--mode",
            "validate",
            "-c",
            "envoy/envoy.yaml",
            "--disable-hot-restart",
            "--log-level",
            "error",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_rendered_config_differs_only_in_addresses_and_paths() -> None:
    import yaml

    from service.app.gateway import render_config

    original = yaml.safe_load((REPO / "envoy/envoy.yaml").read_text())
    rendered = render_config(
        GatewaySettings(http_port=1234, router_port=4321, router_host="router", admin_port=999)
    )
    changed: list[str] = []

    def walk(a: object, b: object, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            assert a.keys() == b.keys(), path
            for key in a:
                walk(a[key], b[key], f"{path}.{key}")
        elif isinstance(a, list) and isinstance(b, list):
            assert len(a) == len(b), path
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}[{i}]")
        elif a != b:
            changed.append(path)

    walk(original, rendered, "")
    assert all(p.endswith(("port_value", "address", "proto_descriptor")) for p in changed), changed
    assert len(changed) == 5, changed



def test_openai_routes_serve_the_tiny_model(deployment: Deployment) -> None:
    # The embedded tiny model carries its own (non-ChatML) chat template.
    status, _, body = http_json(
        deployment.http_port,
        "POST",
        "/v1/chat/completions",
        {"model": "tgi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert status == 200 and body["object"] == "chat.completion", body
    assert body["usage"]["completion_tokens"] <= 2
    status, _, body = http_json(
        deployment.http_port,
        "POST",
        "/v1/completions",
        {"model": "tgi", "prompt": "Once upon a time", "max_tokens": 2},
    )
    assert status == 200 and body["object"] == "text_completion", body
