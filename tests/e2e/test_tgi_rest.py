"""TGI's REST contract end to end through the real Envoy: every route and status of TGI's
docs/openapi.json that tokenwire can be driven into, each body validated against the schema of its
route and status, and TGI's own clients (`text_generation.Client`,
`huggingface_hub.InferenceClient(base_url=...)`) used unchanged.

The schemas are tokenwire's OpenAPI document (service/api/openapi.json, served live at
GET /api-doc/openapi.json), written from TGI's docs/openapi.json and router/src/lib.rs and
stricter than TGI's where TGI always writes a key (`"seed": null`, `"generated_text": null`...):
the keys TGI writes are `required` there, so a missing `null` fails validation.

Not drivable, so not here: TGI's 500 `incomplete_generation` (tokenwire's engine never ends a
sequence without a final token; a shard that does is a 503 "unavailable") and /tokenize's 404 (no
fast tokenizer: tokenwire always loads tokenizer.json).
"""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.app.gateway import Gateway, GatewaySettings
from tests.helpers.http_api import http_json
from tests.helpers.ports import free_port
from tests.helpers.processes import Deployment, launch

pytestmark = pytest.mark.slow

KEY = "tgi-test-key"
MAX_CONCURRENT = 2


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    dep = launch(
        tmp_path_factory.mktemp("tgi"),
        "--max-concurrent-requests",
        str(MAX_CONCURRENT),
        "--max-request-bytes",
        "65536",
        api_key=KEY,
    )
    yield dep
    code = dep.stop()
    assert code == 0, dep.log()


@pytest.fixture(scope="module")
def openapi(deployment: Deployment) -> dict[str, Any]:
    status, headers, doc = call(deployment, "GET", "/api-doc/openapi.json")
    assert status == 200 and headers["content-type"] == "application/json", doc
    assert isinstance(doc, dict) and doc["openapi"].startswith("3.1")
    return doc


def call(
    dep: Deployment, method: str, path: str, body: object = None, *, raw: bytes | None = None,
    headers: dict[str, str] | None = None, auth: bool = True,
) -> tuple[int, dict[str, str], Any]:  # fmt: skip
    all_headers = {**(dep.headers if auth else {}), **(headers or {})}
    assert dep.http_port is not None
    return http_json(dep.http_port, method, path, body, headers=all_headers, raw=raw)


def sse(dep: Deployment, path: str, body: object, headers: dict[str, str] | None = None
        ) -> tuple[int, dict[str, str], list[Any]]:  # fmt: skip
    """POST and read the whole SSE answer: (status, headers, event JSONs in order)."""
    assert dep.http_port is not None
    conn = http.client.HTTPConnection("127.0.0.1", dep.http_port, timeout=120)
    conn.request("POST", path, body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json", **dep.headers, **(headers or {})})
    reply = conn.getresponse()
    raw = reply.read().decode()
    conn.close()
    events = []
    for chunk in raw.split("\n\n"):
        if chunk.strip():
            assert chunk.startswith("data:"), raw
            events.append(json.loads(chunk[len("data:"):]))
    return reply.status, {k.lower(): v for k, v in reply.getheaders()}, events


def check(doc: dict[str, Any], schema: dict[str, Any], value: object) -> None:
    """Validates `value` against `schema`, whose $refs point into the document's components."""
    jsonschema.Draft202012Validator({**schema, "components": doc["components"]}).validate(value)


def response_schema(doc: dict[str, Any], path: str, method: str, status: int,
                    content_type: str) -> dict[str, Any]:  # fmt: skip
    return doc["paths"][path][method]["responses"][str(status)]["content"][content_type]["schema"]


def expect(doc: dict[str, Any], path: str, method: str, got: tuple[int, dict[str, str], Any],
           status: int, error_type: str | None = None) -> Any:  # fmt: skip
    code, headers, body = got
    assert code == status, (path, code, body)
    kind = "application/json"
    assert headers["content-type"].startswith(kind), headers
    check(doc, response_schema(doc, path, method.lower(), status, kind), body)
    if error_type is not None:
        assert body["error_type"] == error_type, body
    return body


GREEDY = {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 6, "details": True,
                                                           "decoder_input_details": True}}


def test_generate_200_nulls_numbers_and_compute_headers(deployment, openapi) -> None:
    got = call(deployment, "POST", "/generate", GREEDY)
    body = expect(openapi, "/generate", "post", got, 200)
    details = body["details"]
    assert details["seed"] is None  # greedy: TGI writes null, not an absent key
    assert details["prefill"][0]["logprob"] is None
    assert all(isinstance(t["logprob"], float) for t in details["prefill"][1:])
    assert "best_of_sequences" not in details and "top_tokens" not in details
    headers = got[1]
    for name in ("x-compute-type", "x-compute-time", "x-compute-characters", "x-total-time",
                 "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token",
                 "x-prompt-tokens", "x-generated-tokens"):  # fmt: skip
        assert name in headers, (name, headers)
    assert int(headers["x-compute-characters"]) == len(GREEDY["inputs"])
    assert int(headers["x-generated-tokens"]) == details["generated_tokens"]
    assert int(headers["x-prompt-tokens"]) == len(details["prefill"])
    assert float(headers["x-compute-time"]) * 1e3 >= int(headers["x-total-time"])

    sampled = {"inputs": "Hello", "parameters": {"max_new_tokens": 3, "details": True,
               "do_sample": True, "seed": 2**63 + 5, "top_n_tokens": 2, "best_of": 2}}  # fmt: skip
    got = call(deployment, "POST", "/generate", sampled)
    details = expect(openapi, "/generate", "post", got, 200)["details"]
    # A 64-bit seed is a JSON number, exact (proto3 JSON would write a string).
    assert type(details["seed"]) is int and details["seed"] in (2**63 + 5, 2**63 + 6)
    assert len(details["top_tokens"]) == details["generated_tokens"]
    assert len(details["best_of_sequences"]) == 1
    assert type(details["best_of_sequences"][0]["seed"]) is int


def test_generate_stream_events_one_by_one(deployment, openapi) -> None:
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 8, "details": True}}
    status, headers, events = sse(deployment, "/generate_stream", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["x-compute-type"] and headers["x-accel-buffering"] == "no"
    schema = response_schema(openapi, "/generate_stream", "post", 200, "text/event-stream")
    for i, event in enumerate(events):
        check(openapi, schema, event)
        assert event["index"] == i + 1  # TGI counts from 1
        if i < len(events) - 1:
            assert event["generated_text"] is None and event["details"] is None
    last = events[-1]
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events
                                             if not e["token"]["special"])  # fmt: skip
    assert last["details"]["seed"] is None and last["details"]["input_length"] > 0


@pytest.mark.parametrize("path", ["/", "/invocations"])
def test_compat_and_sagemaker_routes(deployment, openapi, path) -> None:
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 3}}
    got = call(deployment, "POST", path, body)
    reply = expect(openapi, path, "post", got, 200)
    assert isinstance(reply, list) and len(reply) == 1 and "generated_text" in reply[0]
    status, headers, events = sse(deployment, path, {**body, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    schema = response_schema(openapi, path, "post", 200, "text/event-stream")
    for event in events:
        check(openapi, schema, event)
    assert events[-1]["generated_text"] == reply[0]["generated_text"]
    got = call(deployment, "POST", path, {"inputs": "x", "parameters": {"top_p": 2.0}})
    assert "top_p" in expect(openapi, path, "post", got, 422, "validation")["error"]


def test_sagemaker_chat_body(deployment, openapi) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    got = call(deployment, "POST", "/invocations", chat)
    reply = expect(openapi, "/invocations", "post", got, 200)
    assert reply["object"] == "chat.completion"
    got = call(deployment, "POST", "/invocations", {"prompt": "Once", "max_tokens": 2})
    assert expect(openapi, "/invocations", "post", got, 200)["object"] == "text_completion"
    # SageMaker clients parse TGI's errors, whatever the body's kind.
    got = call(deployment, "POST", "/invocations", {**chat, "max_tokens": -1})
    assert "max_tokens" in expect(openapi, "/invocations", "post", got, 422, "validation")["error"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"inputs": ""}, "inputs"),
        ({"inputs": "x", "parameters": {"temperature": -1.0}}, "temperature"),
        ({"inputs": "x", "parameters": {"max_new_tokens": 100000}}, "max_new_tokens"),
        ({"inputs": "x", "parameters": {"max_new_tokens": "ten"}}, "max_new_tokens"),
        ({"inputs": 5}, "inputs"),
        ({"parameters": {}}, "inputs"),
        ({"inputs": "x", "parameters": {"stop": "no"}}, "stop"),
        ({"inputs": "x", "parameters": {"seed": -1}}, "seed"),
    ],
)
def test_invalid_input_is_422_naming_the_field(deployment, openapi, body, field) -> None:
    got = call(deployment, "POST", "/generate", body)
    assert field in expect(openapi, "/generate", "post", got, 422, "validation")["error"]
    # The stream answers 200 with TGI's in-band error event (its SSE headers go out first).
    status, _, events = sse(deployment, "/generate_stream", body)
    assert status == 200 and len(events) == 1, events
    schema = response_schema(openapi, "/generate_stream", "post", 200, "text/event-stream")
    check(openapi, schema, events[0])
    assert events[0]["error_type"] == "validation" and field in events[0]["error"]


def test_malformed_json_413_401_404(deployment, openapi) -> None:
    got = call(deployment, "POST", "/generate", raw=b'{"inputs":')
    expect(openapi, "/generate", "post", got, 422, "validation")
    got = call(deployment, "POST", "/generate", {"inputs": "a" * 100_000})
    expect(openapi, "/generate", "post", got, 413, "validation")
    got = call(deployment, "POST", "/generate", {"inputs": "x"}, auth=False)
    expect(openapi, "/generate", "post", got, 401, "unauthorized")
    status, _, body = call(deployment, "GET", "/nope")
    assert status == 404 and body["error_type"] == "not_found" and "/generate" in body["error"]


@pytest.mark.parametrize("path", ["/generate", "/", "/invocations"])
def test_deadline_mid_generation_is_424(deployment, openapi, path) -> None:
    body = {"inputs": "Once", "parameters": {"max_new_tokens": 1000}}
    got = call(deployment, "POST", path, body, headers={"grpc-timeout": "300m"})
    expect(openapi, path, "post", got, 424, "generation")


def test_deadline_mid_stream_is_in_band(deployment) -> None:
    body = {"inputs": "Once", "parameters": {"max_new_tokens": 1000}}
    status, _, events = sse(deployment, "/generate_stream", body, {"grpc-timeout": "400m"})
    assert status == 200 and len(events) > 1
    assert events[-1]["error_type"] == "generation" and set(events[-1]) == {"error", "error_type"}


OVERLOAD_PATHS = ("/generate", "/", "/invocations", "/generate_stream")


def test_over_capacity_is_429_or_an_overloaded_event(deployment, openapi) -> None:
    body = {"inputs": "The router batches", "parameters": {"max_new_tokens": 150}}
    results: list[tuple[str, tuple[int, dict[str, str], Any]]] = []
    lock = threading.Lock()

    def one(path: str) -> None:
        if path == "/generate_stream":
            status, headers, events = sse(deployment, path, body)
            got: tuple[int, dict[str, str], Any] = (status, headers, events)
        else:
            got = call(deployment, "POST", path, body)
        with lock:
            results.append((path, got))

    threads = [threading.Thread(target=one, args=(OVERLOAD_PATHS[i % 4],))
               for i in range(4 * MAX_CONCURRENT)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    refused = 0
    for path, got in results:
        if path == "/generate_stream":
            assert got[0] == 200
            if got[2][-1].get("error_type") is not None:
                assert got[2] == [{"error": got[2][0]["error"], "error_type": "overloaded"}]
                refused += 1
        elif got[0] == 429:
            expect(openapi, path, "post", got, 429, "overloaded")
            refused += 1
        else:
            expect(openapi, path, "post", got, 200)
    assert 0 < refused < len(results), results


def test_info_health_ping_metrics_tokenize(deployment, openapi) -> None:
    got = call(deployment, "GET", "/info")
    info = expect(openapi, "/info", "get", got, 200)
    assert info["max_concurrent_requests"] == MAX_CONCURRENT
    assert type(info["max_batch_total_tokens"]) is int and info["max_batch_total_tokens"] > 0
    for path in ("/health", "/ping"):
        status, _, body = call(deployment, "GET", path, auth=False)
        assert status == 200 and body == "", (path, body)
    status, headers, text = call(deployment, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    # The whole router's text, as --prometheus-port serves it (with front ends: merged, engine
    # metrics included, which only the scheduler process has).
    assert "tokenwire_request_count" in text and "tokenwire_kv_blocks_used" in text
    got = call(deployment, "POST", "/tokenize", {"inputs": "Hello world"})
    tokens = expect(openapi, "/tokenize", "post", got, 200)
    assert "".join(t["text"] for t in tokens).strip() != ""
    got = call(deployment, "POST", "/tokenize", {"inputs": ""})
    expect(openapi, "/tokenize", "post", got, 422, "validation")


def test_chat_tokenize(deployment, openapi) -> None:
    body = {"messages": [{"role": "user", "content": "What is Deep Learning?"}]}
    got = call(deployment, "POST", "/chat_tokenize", body)
    reply = expect(openapi, "/chat_tokenize", "post", got, 200)
    assert "What is Deep Learning?" in reply["templated_text"]
    assert reply["templated_text"].startswith(reply["tokenize_response"][0]["text"])
    got = call(deployment, "POST", "/chat_tokenize", {"messages": "nope"})
    expect(openapi, "/chat_tokenize", "post", got, 422, "validation")
    got = call(deployment, "POST", "/chat_tokenize", {**body, "model": "other"})
    expect(openapi, "/chat_tokenize", "post", got, 404, "not_found")


def test_openapi_document_describes_the_live_server(deployment, openapi) -> None:
    """Every path the document lists is served (no 404), and TGI's documented paths are all
    there."""
    tgi_paths = {"/", "/chat_tokenize", "/generate", "/generate_stream", "/health", "/info",
                 "/invocations", "/metrics", "/tokenize", "/v1/chat/completions",
                 "/v1/completions", "/v1/models"}  # fmt: skip
    assert tgi_paths <= set(openapi["paths"])
    for path, methods in openapi["paths"].items():
        for method in methods:
            body = {} if method == "post" else None
            status, _, reply = call(deployment, method.upper(), path, body)
            assert status != 404 or path == "/chat_tokenize", (path, status, reply)
            assert status < 500, (path, status, reply)


_SCALARS = st.none() | st.booleans() | st.integers(-5, 2**65) | st.floats() | st.text(max_size=8)
_PARAMS = st.dictionaries(
    st.sampled_from(["best_of", "temperature", "top_k", "top_p", "typical_p", "do_sample",
                     "max_new_tokens", "stop", "seed", "details", "decoder_input_details",
                     "top_n_tokens", "grammar", "truncate", "repetition_penalty",
                     "frequency_penalty", "return_full_text", "watermark", "adapter_id"]),
    _SCALARS | st.lists(_SCALARS, max_size=3) | st.fixed_dictionaries(
        {"type": st.sampled_from(["json", "regex", "json_schema", "nope"]),
         "value": _SCALARS | st.dictionaries(st.text(max_size=4), _SCALARS, max_size=2)}),
    max_size=5,
)  # fmt: skip
_BODIES = st.one_of(
    _SCALARS,
    st.fixed_dictionaries({"inputs": st.text(max_size=20) | _SCALARS},
                          optional={"parameters": _PARAMS | _SCALARS, "stream": _SCALARS,
                                    "messages": _SCALARS | st.lists(_SCALARS, max_size=2)}),
)  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_BODIES, path=st.sampled_from(["/generate", "/generate_stream", "/", "/invocations",
                                           "/tokenize", "/chat_tokenize"]))  # fmt: skip
def test_fuzzed_bodies_never_5xx_and_4xx_is_tgi_shape(deployment, openapi, body, path) -> None:
    """Random JSON bodies on every body-taking route: never a 5xx; every 4xx is TGI's
    ErrorResponse; a 200 stream's events are each a StreamResponse or an ErrorResponse."""
    if isinstance(body, dict) and isinstance(body.get("parameters"), dict):
        # Keep generations short on the shared CPU: an over-long one is still validated.
        body["parameters"].setdefault("max_new_tokens", 4)
    status, headers, reply = call(deployment, "POST", path, raw=json.dumps(body).encode())
    assert status < 500, (path, body, status, reply)
    if status >= 400:
        check(openapi, {"$ref": "#/components/schemas/ErrorResponse"}, reply)
    elif headers["content-type"].startswith("text/event-stream"):
        event = {"$ref": "#/components/schemas/StreamEvent"}
        for chunk in str(reply).split("\n\n"):
            if chunk.strip() and path != "/invocations":
                check(openapi, event, json.loads(chunk[len("data:"):]))


def test_router_down_is_503_in_tgi_shape(tmp_path: Path) -> None:
    gateway = Gateway(
        GatewaySettings(http_port=free_port(), http_host="127.0.0.1", router_port=free_port())
    )
    gateway.start()
    try:
        gateway.wait_ready(30)
        for method, path, body in (("POST", "/generate", {"inputs": "x"}),
                                   ("GET", "/health", None), ("GET", "/info", None)):  # fmt: skip
            status, headers, reply = http_json(gateway.settings.http_port, method, path, body)
            assert status == 503 and headers["content-type"] == "application/json", reply
            assert set(reply) == {"error", "error_type"} and reply["error_type"] == "unavailable"
    finally:
        gateway.stop()


# --- TGI's own clients, unchanged -----------------------------------------------------------


def test_text_generation_client(deployment) -> None:
    import text_generation  # installed by `make setup` (--no-deps; see the Makefile)
    from text_generation import errors

    base = f"http://127.0.0.1:{deployment.http_port}"
    client = text_generation.Client(base, headers=deployment.headers, timeout=60)
    reply = client.generate("The quick brown fox", max_new_tokens=5, decoder_input_details=True)
    assert reply.details.generated_tokens == len(reply.details.tokens) > 0
    assert reply.details.seed is None and reply.details.prefill[0].logprob is None
    tokens = list(client.generate_stream("The quick brown fox", max_new_tokens=5))
    assert "".join(t.token.text for t in tokens if not t.token.special) == tokens[-1].generated_text
    assert tokens[-1].generated_text == reply.generated_text
    with pytest.raises(errors.ValidationError, match="max_new_tokens"):
        client.generate("x", max_new_tokens=100000)
    with pytest.raises(errors.ValidationError, match="max_new_tokens"):
        list(client.generate_stream("x", max_new_tokens=100000))


def test_huggingface_hub_inference_client(deployment) -> None:
    from huggingface_hub import InferenceClient, errors

    client = InferenceClient(base_url=f"http://127.0.0.1:{deployment.http_port}", api_key=KEY)
    out = client.text_generation("The quick brown fox", max_new_tokens=5, details=True)
    assert out.details is not None and out.details.generated_tokens > 0
    assert out.details.seed is None
    streamed = list(client.text_generation("The quick brown fox", max_new_tokens=5,
                                           stream=True, details=True))  # fmt: skip
    assert streamed[-1].generated_text == out.generated_text
    assert all(s.generated_text is None for s in streamed[:-1])
    with pytest.raises(errors.ValidationError, match="max_new_tokens"):
        client.text_generation("x", max_new_tokens=100000)
    with pytest.raises(errors.ValidationError, match="max_new_tokens"):
        list(client.text_generation("x", max_new_tokens=100000, stream=True))


def test_clients_raise_overloaded(deployment) -> None:
    import text_generation
    from huggingface_hub import InferenceClient
    from huggingface_hub import errors as hf_errors
    from text_generation import errors as tg_errors

    base = f"http://127.0.0.1:{deployment.http_port}"
    tg = text_generation.Client(base, headers=deployment.headers, timeout=120)
    hf = InferenceClient(base_url=base, api_key=KEY)
    caught: list[BaseException] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            if i % 2:
                tg.generate("The router batches", max_new_tokens=150)
            else:
                hf.text_generation("The router batches", max_new_tokens=150)
        except Exception as error:  # noqa: BLE001 - collected and checked below
            with lock:
                caught.append(error)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4 * MAX_CONCURRENT)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert caught, "no request was refused"
    assert all(isinstance(e, (tg_errors.OverloadedError, hf_errors.OverloadedError))
               for e in caught), caught  # fmt: skip
