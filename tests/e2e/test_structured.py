"""Structured output end to end with the real model (SmolLM2-135M-Instruct): the official `openai`
client through the real Envoy (response_format json_schema / json_object, tool calling), TGI's
`parameters.grammar` over REST and typed gRPC, a mixed constrained/unconstrained batch, and bad
grammars. One deployment serves the module; the schema suite runs as one concurrent batch."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest
from google.protobuf import json_format
from tokenwire.v1 import generate_pb2 as gpb
from tokenwire.v1 import generate_pb2_grpc as gpb_grpc
from tokenwire.v1 import openai_pb2 as opb
from tokenwire.v1 import openai_pb2_grpc as opb_grpc

from tests.helpers.http_api import http_json
from tests.helpers.processes import Deployment, launch
from tests.helpers.schemas import SCHEMAS, TOOLS
from tests.helpers.smollm2 import snapshot

# The first test's setup may convert SmolLM2's GGUF (tests/helpers/smollm2.py: ~20-70 s quiet,
# 285 s measured on a 2-core host ~7x oversubscribed) before its launch (with a deadline of
# its own): the default 300 s a test would cut the setup short of that deadline.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CONCURRENT = 32


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    model_dir: Path = snapshot(tmp_path_factory)
    dep = launch(
        tmp_path_factory.mktemp("structured"),
        "--model-id", str(model_dir),
        "--dtype", "float32",
        "--kv-cache-memory-mb", "512",
        "--max-total-tokens", "1024",
        "--max-input-tokens", "900",
        "--max-concurrent-requests", str(CONCURRENT),
        timeout=400.0,
    )  # fmt: skip
    yield dep
    code = dep.stop()
    assert code == 0, dep.log()


@pytest.fixture(scope="module")
def client(deployment: Deployment) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://{deployment.envoy_target}/v1", api_key="unused", max_retries=0
    )


def _json_chat(client: openai.OpenAI, name: str, what: str, schema: dict) -> tuple[str, str]:
    reply = client.chat.completions.create(
        model="tgi",
        messages=[
            {"role": "system", "content": "You answer with JSON only."},
            {"role": "user", "content": f"Give me {what} as JSON."},
        ],
        temperature=0,
        max_tokens=120,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        },
    )
    choice = reply.choices[0]
    return choice.message.content or "", choice.finish_reason


def test_every_schema_of_the_suite_gives_json_that_validates(client: openai.OpenAI) -> None:
    assert len(SCHEMAS) >= 20
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # one concurrent batch on the server
        outputs = list(pool.map(lambda s: _json_chat(client, *s), SCHEMAS))
    failures = []
    for (name, _, schema), (text, finish) in zip(SCHEMAS, outputs, strict=True):
        try:
            jsonschema.validate(json.loads(text), schema)
            assert finish == "stop", finish  # grammar complete -> EOS -> "stop"
        except Exception as error:  # noqa: BLE001 - collect them all for one message
            failures.append(f"{name}: {error!r} in {text!r} ({finish})")
    assert not failures, "\n".join(failures)


def test_json_object_mode_and_the_stream_agree(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Describe a cat as a JSON object."}]
    kwargs: dict = dict(model="tgi", messages=messages, temperature=0, max_tokens=24,
                  response_format={"type": "json_object"})
    with ThreadPoolExecutor(2) as pool:  # unary and streamed side by side
        streaming = pool.submit(
            lambda: list(client.chat.completions.create(stream=True, **kwargs))
        )
        reply = client.chat.completions.create(**kwargs)
        chunks = streaming.result()
    text = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert text.startswith("{")
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text


REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no)",
    r"[A-Z][a-z]{2,8}, [A-Z][a-z]{2,8}",
    r"\d+(\.\d{1,2})? (EUR|USD)",
    r"#[0-9a-f]{6}",
]


def _tgi(deployment: Deployment, inputs: str, grammar: dict | None, max_new_tokens: int = 24):
    params: dict = {"max_new_tokens": max_new_tokens, "details": True}
    if grammar is not None:
        params["grammar"] = grammar
    return http_json(
        deployment.http_port, "POST", "/generate", {"inputs": inputs, "parameters": params},
        timeout=120,
    )


def test_regex_outputs_fullmatch_their_pattern(deployment: Deployment) -> None:
    prompt = "<|im_start|>user\nAnswer briefly.<|im_end|>\n<|im_start|>assistant\n"
    with ThreadPoolExecutor(len(REGEXES)) as pool:
        answers = list(
            pool.map(lambda r: _tgi(deployment, prompt, {"type": "regex", "value": r}), REGEXES)
        )
    for pattern, (status, _, body) in zip(REGEXES, answers, strict=True):
        assert status == 200, body
        assert re.fullmatch(pattern, body["generated_text"]), (pattern, body)
        assert body["details"]["finish_reason"] == "eos_token", body


def test_tgi_json_grammar_over_typed_grpc(deployment: Deployment) -> None:
    schema = SCHEMAS[0][2]
    request = gpb.GenerateRequest(
        inputs="<|im_start|>user\nA person as JSON.<|im_end|>\n<|im_start|>assistant\n",
        parameters=gpb.GenerateParameters(max_new_tokens=60, details=True),
    )
    request.parameters.grammar.type = "json"
    json_format.ParseDict(schema, request.parameters.grammar.value)
    with grpc.insecure_channel(deployment.target) as channel:
        reply = gpb_grpc.TextGenerationStub(channel).Generate(request, timeout=120)
    jsonschema.validate(json.loads(reply.generated_text), schema)
    assert reply.details.finish_reason == "eos_token"


def _tool_conversations() -> list[tuple[list[dict], object, list[dict]]]:
    """(messages, tool_choice, tools) of ten conversations; several continue after a call."""
    weather, add, books = TOOLS
    called = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris",
                                                            "unit": "celsius"})}}],
    }
    answered = {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}
    named = {"type": "function", "function": {"name": "add"}}
    return [
        ([{"role": "user", "content": "What is the weather in Paris?"}], "required", [weather]),
        ([{"role": "user", "content": "How warm is it in Oslo, in fahrenheit?"}], "required",
         TOOLS),
        ([{"role": "user", "content": "What is 2 plus 40?"}], named, TOOLS),
        ([{"role": "user", "content": "Add 7 and -3."}], "required", [add]),
        ([{"role": "user", "content": "Find two books by Tolkien."}], "required", [books]),
        ([{"role": "user", "content": "Any books by Austen?"}],
         {"type": "function", "function": {"name": "search_books"}}, TOOLS),
        ([{"role": "user", "content": "Weather in Paris?"}, called, answered,
          {"role": "user", "content": "And in Rome?"}], "required", TOOLS),
        ([{"role": "system", "content": "You are a calculator."},
          {"role": "user", "content": "Sum 100 and 23."}], "required", [add, weather]),
        ([{"role": "user", "content": "Weather in Paris?"}, called, answered,
          {"role": "user", "content": "Now add 21 and 4."}], named, TOOLS),
        ([{"role": "user", "content": "Weather in Berlin and in Madrid?"}], "required", TOOLS),
    ]


def test_ten_tool_calling_conversations_return_calls_that_validate(
    client: openai.OpenAI,
) -> None:
    conversations = _tool_conversations()
    assert len(conversations) == 10

    def run(case, stream=False):
        messages, choice, tools = case
        return client.chat.completions.create(
            model="tgi", messages=messages, tools=tools, tool_choice=choice, temperature=0,
            max_tokens=96, stream=stream,
        )

    with ThreadPoolExecutor(len(conversations) + 1) as pool:
        # The first conversation is also streamed, in the same batch.
        streamed = pool.submit(lambda: list(run(conversations[0], stream=True)))
        replies = list(pool.map(run, conversations))
        chunks = streamed.result()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for (messages, choice, tools), reply in zip(conversations, replies, strict=True):
        out = reply.choices[0]
        assert out.finish_reason == "tool_calls", (messages, out)
        assert out.message.content is None and out.message.tool_calls, out
        allowed = {t["function"]["name"] for t in tools}
        if isinstance(choice, dict):
            allowed = {choice["function"]["name"]}
        for call in out.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            assert call.function.name in allowed
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    # Streamed: a call's first piece carries its id and name, the next ones more of its
    # arguments; joined, the same calls as unary.
    calls: dict[int, tuple[str, str]] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if delta.index not in calls:
                assert delta.id.startswith("call_") and delta.type == "function"
                calls[delta.index] = (delta.function.name, "")
            name, arguments = calls[delta.index]
            calls[delta.index] = (name, arguments + (delta.function.arguments or ""))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    unary = replies[0].choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in unary] == [
        calls[i] for i in sorted(calls)
    ]


def test_tool_choice_auto_gives_text_or_valid_calls(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tgi", messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS,
        temperature=0, max_tokens=24,
    )
    out = reply.choices[0]
    if out.message.tool_calls:
        assert out.finish_reason == "tool_calls"
    else:
        assert out.message.content and not out.message.content.startswith("<tool_call>")


def test_typed_chat_carries_response_format_and_tools(deployment: Deployment) -> None:
    schema = SCHEMAS[1][2]
    request = opb.ChatRequest(
        model="tgi",
        messages=[opb.ChatMessage(role="user", content="Pick a color as JSON.")],
        max_tokens=40, temperature=0,
    )
    request.response_format.type = "json_schema"
    request.response_format.json_schema.name = "color"
    json_format.ParseDict(schema, request.response_format.json_schema.schema)
    tool_request = opb.ChatRequest(
        model="tgi", messages=[opb.ChatMessage(role="user", content="Add 1 and 2.")],
        max_tokens=60, temperature=0,
        tools=[opb.Tool(type="function", function=opb.FunctionDefinition(name="add"))],
    )
    json_format.ParseDict(TOOLS[1]["function"]["parameters"],
                          tool_request.tools[0].function.parameters)
    tool_request.tool_choice.function = "add"
    tool_request.parallel_tool_calls = False  # exactly one call
    with grpc.insecure_channel(deployment.target) as channel:
        stub = opb_grpc.OpenAIServiceStub(channel)
        pending = stub.Chat.future(request, timeout=120)  # both in one batch
        tool_reply = stub.Chat(tool_request, timeout=120)
        reply = pending.result()
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    (call,) = tool_reply.choices[0].message.tool_calls
    assert tool_reply.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[1]["function"]["parameters"])


def test_mixed_batch_leaves_unconstrained_greedy_text_unchanged(deployment: Deployment) -> None:
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    alone = _tgi(deployment, prompt, None, 16)[2]["generated_text"]
    constrained = [{"type": "json", "value": s} for _, _, s in SCHEMAS[:4]] + [
        {"type": "regex", "value": REGEXES[0]}
    ]
    with ThreadPoolExecutor(len(constrained) + 2) as pool:
        busy = [pool.submit(_tgi, deployment, prompt, g, 30) for g in constrained]
        mixed = [pool.submit(_tgi, deployment, prompt, None, 16) for _ in range(2)]
        together = [f.result()[2]["generated_text"] for f in mixed]
        for f in busy:
            assert f.result()[0] == 200
    assert together == [alone, alone]


@pytest.mark.parametrize(
    ("grammar", "says"),
    [
        ({"type": "regex", "value": "([a-z]"}, "regular expression"),
        ({"type": "json", "value": {"type": "strin"}}, "Invalid type"),
        ({"type": "json", "value": {"type": "integer", "minimum": 5, "maximum": 1}},
         "Unsatisfiable"),
        ({"type": "json", "value": {"allOf": [{"type": "string"}, {"type": "integer"}]}},
         "Unsatisfiable"),
    ],
    ids=["invalid_regex", "invalid_schema", "unsatisfiable_bounds", "unsatisfiable_types"],
)
def test_bad_grammars_are_400_naming_the_field(deployment, grammar, says) -> None:
    status, _, body = _tgi(deployment, "Hello", grammar)
    assert status == 422 and body["error_type"] == "validation", body
    assert "parameters.grammar" in body["error"] and says in body["error"], body
    status, _, _ = http_json(deployment.http_port, "GET", "/health")
    assert status == 200


def test_bad_response_format_is_an_openai_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tgi", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "integer", "minimum": 3, "maximum": 2}}},
        )
    assert caught.value.body["param"] == "response_format"
    reply = client.chat.completions.create(
        model="tgi", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert reply.choices[0].message.content
