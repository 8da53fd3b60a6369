"""OpenAI's Responses API and Anthropic's Messages API end to end: the official `openai` and
`anthropic` Python clients, unchanged, with base_url at the real Envoy in front of a real
`tokenwire launch` serving the tiny random model (greedy, few tokens); raw HTTP for x-api-key
and fuzzed bodies. One deployment serves the module (a store of 3 responses, 2 requests at
once so that a third is refused with 429)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.http_api import http_json
from tests.helpers.metrics import scrape
from tests.helpers.processes import Deployment, launch

pytestmark = pytest.mark.slow

API_KEY = "test-key"
MAX_CONCURRENT = 2
STORE_SIZE = 3
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
RESPONSES_TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}
]
MESSAGES_TOOLS: list[Any] = [{"name": "get_weather", "input_schema": CITY}]
GREEDY = {"temperature": 0}
USER = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    dep = launch(
        tmp_path_factory.mktemp("agents"),
        "--max-concurrent-requests", str(MAX_CONCURRENT),
        "--max-total-tokens", "1024",
        "--responses-store-size", str(STORE_SIZE),
        api_key=API_KEY,
    )  # fmt: skip
    yield dep
    code = dep.stop()
    assert code == 0, dep.log()


@pytest.fixture(scope="module")
def oai(deployment: Deployment) -> openai.OpenAI:
    # No retries: a 429 must reach the test as RateLimitError at once.
    return openai.OpenAI(
        base_url=f"http://{deployment.envoy_target}/v1", api_key=API_KEY, max_retries=0
    )


@pytest.fixture(scope="module")
def claude(deployment: Deployment) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=f"http://{deployment.envoy_target}", api_key=API_KEY, max_retries=0
    )


def _idle(deployment: Deployment) -> None:
    """Waits until no request is in flight (closed streams release their slot asynchronously)."""
    deadline = time.monotonic() + 30
    while scrape(deployment.metrics_port)["tokenwire_requests_in_flight"] > 0:
        assert time.monotonic() < deadline, "requests stayed in flight"
        time.sleep(0.05)


# --- OpenAI Responses ----------------------------------------------------------------------


def test_responses_text_retrieve_and_delete(oai: openai.OpenAI, deployment: Deployment) -> None:
    before = scrape(deployment.metrics_port).total("tokenwire_request_count_total", method="responses")
    response = oai.responses.create(
        model="tgi", input="Say hello.", instructions="Be brief.", max_output_tokens=6, **GREEDY
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete"  # six random tokens: cut by max_output_tokens
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text and response.usage is not None
    assert response.usage.output_tokens == 6
    assert response.usage.total_tokens == response.usage.input_tokens + 6
    assert response.instructions == "Be brief." and response.max_output_tokens == 6
    stored = oai.responses.retrieve(response.id)
    assert stored.id == response.id and stored.output_text == response.output_text
    after = scrape(deployment.metrics_port).total("tokenwire_request_count_total", method="responses")
    assert after == before + 1  # the route has its own metrics label
    oai.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(response.id)


def test_responses_stream_reassembles_to_the_unary_answer(oai: openai.OpenAI) -> None:
    unary = oai.responses.create(model="tgi", input=USER, max_output_tokens=8, **GREEDY)
    kinds: list[str] = []
    deltas: list[str] = []
    with oai.responses.stream(model="tgi", input=USER, max_output_tokens=8, **GREEDY) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    assert len(deltas) >= 2 and "".join(deltas) == unary.output_text


def test_responses_structured_output_streams_and_validates(oai: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    text = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    with oai.responses.stream(
        model="tgi", input="Answer in JSON.", text=text, max_output_tokens=60, **GREEDY  # type: ignore[arg-type]
    ) as stream:
        final = stream.get_final_response()  # needs response.completed: the grammar ended it
    assert final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), schema)
    assert final.text.format.type == "json_schema"  # type: ignore[union-attr]


def test_responses_two_turn_tool_conversation(oai: openai.OpenAI) -> None:
    first = oai.responses.create(
        model="tgi", input="What is the weather in Paris?", tools=RESPONSES_TOOLS,
        tool_choice="required", parallel_tool_calls=False, max_output_tokens=80, **GREEDY,
    )  # fmt: skip
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY)
    # Turn two continues the stored conversation and streams; the tool's answer goes in.
    with oai.responses.stream(
        model="tgi", previous_response_id=first.id, tools=RESPONSES_TOOLS, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        max_output_tokens=4, **GREEDY,
    ) as stream:  # fmt: skip
        second = next(e.response for e in stream if e.type == "response.incomplete")
    assert second.previous_response_id == first.id
    assert [item.type for item in second.output] == ["message"]
    # The second prompt holds the question, the call and the tool's answer: more than the
    # question alone under the same tool_choice (tools are rendered only when active).
    alone = oai.responses.create(model="tgi", input="What is the weather in Paris?",
                                 tools=RESPONSES_TOOLS, tool_choice="none", max_output_tokens=1)
    assert alone.usage is not None and second.usage is not None
    assert second.usage.input_tokens > alone.usage.input_tokens + 4
    # The same call, streamed: the SDK reassembles the arguments from their delta events.
    with oai.responses.stream(
        model="tgi", input="What is the weather in Paris?", tools=RESPONSES_TOOLS,
        tool_choice="required", parallel_tool_calls=False, max_output_tokens=80, **GREEDY,
    ) as stream:  # fmt: skip
        streamed = stream.get_final_response()
    [again] = streamed.output
    assert again.type == "function_call" and again.arguments == call.arguments


def test_previous_response_id_needs_a_stored_response(oai: openai.OpenAI) -> None:
    unstored = oai.responses.create(model="tgi", input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(model="tgi", input="again", previous_response_id=unstored.id,
                             max_output_tokens=2)  # fmt: skip
    assert caught.value.param == "previous_response_id"  # type: ignore[attr-defined]


def test_store_evicts_beyond_its_size_and_counts_it(
    oai: openai.OpenAI, deployment: Deployment
) -> None:
    def evictions() -> float:
        return scrape(deployment.metrics_port).total(
            "tokenwire_responses_store_evictions_total", reason="size"
        )

    before = evictions()
    ids = [oai.responses.create(model="tgi", input=f"n{i}", max_output_tokens=1).id
           for i in range(STORE_SIZE + 1)]  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(ids[0])  # the least recently used went first
    assert [oai.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    assert evictions() >= before + 1
    assert scrape(deployment.metrics_port)["tokenwire_responses_stored"] == STORE_SIZE


# --- Anthropic Messages --------------------------------------------------------------------


def test_messages_text_stream_and_count_tokens(
    claude: anthropic.Anthropic, deployment: Deployment
) -> None:
    message = claude.messages.create(
        model="tgi", max_tokens=8, messages=USER, system="Be brief.", extra_body=GREEDY
    )  # type: ignore[arg-type]
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8
    [block] = message.content
    assert block.type == "text" and block.text
    counted = claude.messages.count_tokens(model="tgi", messages=USER, system="Be brief.")  # type: ignore[arg-type]
    assert counted.input_tokens == message.usage.input_tokens
    kinds: list[str] = []
    with claude.messages.stream(
        model="tgi", max_tokens=8, messages=USER, system="Be brief.", extra_body=GREEDY
    ) as stream:  # type: ignore[arg-type]
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert final.content[0].text == block.text  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    assert final.usage.input_tokens == message.usage.input_tokens
    assert scrape(deployment.metrics_port).total("tokenwire_request_count_total", method="messages") >= 1


def test_messages_stop_sequences_report_which_one(claude: anthropic.Anthropic) -> None:
    text = claude.messages.create(model="tgi", max_tokens=8, messages=USER, extra_body=GREEDY  # type: ignore[arg-type]
                                  ).content[0].text  # type: ignore[union-attr]  # fmt: skip
    stop = text.strip()[2:4]  # a piece of the greedy text, found after its start
    assert stop
    message = claude.messages.create(
        model="tgi", max_tokens=8, messages=USER, stop_sequences=[stop], extra_body=GREEDY
    )  # type: ignore[arg-type]
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


def test_messages_two_turn_tool_conversation(claude: anthropic.Anthropic) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = claude.messages.create(
        model="tgi", max_tokens=80, messages=[question], tools=MESSAGES_TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY,
    )  # type: ignore[arg-type]  # fmt: skip
    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, CITY)
    # The same call streamed: input_json_delta reassembled by the SDK.
    with claude.messages.stream(
        model="tgi", max_tokens=80, messages=[question], tools=MESSAGES_TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY,
    ) as stream:  # type: ignore[arg-type]  # fmt: skip
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[0].input == use.input  # type: ignore[union-attr]
    second = claude.messages.create(
        model="tgi", max_tokens=4, tools=MESSAGES_TOOLS, extra_body=GREEDY,
        messages=[question, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}],
        tool_choice={"type": "none"},
    )  # type: ignore[arg-type]  # fmt: skip
    assert [b.type for b in second.content] == ["text"]
    # The second prompt holds the question, the call and the tool's answer: more than the
    # question alone under the same tool_choice (tools are rendered only when active).
    alone = claude.messages.count_tokens(model="tgi", messages=[question], tools=MESSAGES_TOOLS,
                                         tool_choice={"type": "none"})  # type: ignore[arg-type]
    assert second.usage.input_tokens > alone.input_tokens + 4


def test_messages_structured_output(claude: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    message = claude.messages.create(
        model="tgi", max_tokens=60, messages=USER, extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )  # type: ignore[arg-type]  # fmt: skip
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)  # type: ignore[union-attr]


def test_x_api_key_and_request_id(deployment: Deployment) -> None:
    body = {"model": "tgi", "max_tokens": 2, "messages": USER}
    status, headers, reply = http_json(
        deployment.http_port, "POST", "/v1/messages", body,
        headers={"x-api-key": API_KEY, "x-request-id": "agent-41"},
    )  # fmt: skip
    assert status == 200 and reply["type"] == "message", reply  # type: ignore[index]
    assert headers["x-request-id"] == "agent-41"
    status, _, reply = http_json(deployment.http_port, "POST", "/v1/messages", body,
                                 headers={"x-api-key": "wrong"})  # fmt: skip
    assert status == 401
    assert reply == {"type": "error", "error": {"type": "authentication_error",
                                                "message": reply["error"]["message"]}}  # type: ignore[index]  # fmt: skip


# --- errors in each SDK's own classes -------------------------------------------------------


def test_image_parts_to_a_text_only_model_are_refused(
    oai: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    # The tiny text model has no image processor: each API's image part is refused as chat's
    # image_url part is (the same check), naming the part, in that API's error shape.
    url = "data:image/png;base64,AA=="
    with pytest.raises(openai.BadRequestError) as bad:
        oai.responses.create(model="tgi", max_output_tokens=2, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": url}]}])
    assert bad.value.param == "input[0].content[1].image_url"  # type: ignore[attr-defined]
    assert "this model takes no images" in bad.value.message
    with pytest.raises(anthropic.BadRequestError) as bad_claude:
        claude.messages.create(model="tgi", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AA=="}}]}])
    assert bad_claude.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "messages[0].content[0].source: this model takes no images" in bad_claude.value.message


def test_each_sdk_raises_its_own_errors(
    oai: openai.OpenAI, claude: anthropic.Anthropic, deployment: Deployment
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        oai.responses.create(model="tgi", input="x", max_output_tokens=0)
    assert bad.value.param == "max_output_tokens"  # type: ignore[attr-defined]
    with pytest.raises(anthropic.BadRequestError) as bad_claude:
        claude.messages.create(model="tgi", max_tokens=0, messages=USER)
    assert bad_claude.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "max_tokens" in bad_claude.value.message
    wrong = openai.OpenAI(base_url=oai.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.responses.create(model="tgi", input="x", max_output_tokens=1)
    wrong_claude = anthropic.Anthropic(base_url=str(claude.base_url), api_key="wrong",
                                       max_retries=0)  # fmt: skip
    with pytest.raises(anthropic.AuthenticationError):
        wrong_claude.messages.create(model="tgi", max_tokens=1, messages=USER)
    # MAX_CONCURRENT long streams held open, each read up to its first event: a third call is
    # refused at once with 429, whichever API it comes through.
    streams = [
        oai.responses.create(model="tgi", input="x", max_output_tokens=900, stream=True)
        for _ in range(MAX_CONCURRENT)
    ]
    try:
        for stream in streams:
            next(iter(stream))
        with pytest.raises(openai.RateLimitError):
            oai.responses.create(model="tgi", input="x", max_output_tokens=1)
        with pytest.raises(anthropic.RateLimitError) as limited:
            claude.messages.create(model="tgi", max_tokens=1, messages=USER)
        assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    finally:
        for stream in streams:
            stream.close()
    _idle(deployment)


# --- fuzzed bodies --------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8,
)  # fmt: skip


def _maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return valid | _json


_responses_body = st.fixed_dictionaries(
    # max_output_tokens always sent (else a valid body generates the default 100 tokens).
    {"model": _maybe(st.just("tgi")), "max_output_tokens": _maybe(st.integers(-1, 2))},
    optional={
        "input": _maybe(st.just("hi") | st.just([{"role": "user", "content": "hi"}])
                        | st.just([{"type": "function_call_output", "call_id": "c", "output": "o"}])),
        "instructions": _json,
        "temperature": _json, "top_p": _json, "stream": _maybe(st.booleans()),
        "store": _json, "previous_response_id": _json,
        "tools": _maybe(st.just(RESPONSES_TOOLS)), "tool_choice": _json,
        "text": _maybe(st.just({"format": {"type": "json_object"}})),
    },
)  # fmt: skip
_messages_body = st.fixed_dictionaries(
    {"model": _maybe(st.just("tgi")), "max_tokens": _maybe(st.integers(-1, 2))},
    optional={
        "messages": _maybe(st.just(USER) | st.lists(st.fixed_dictionaries(
            {"role": _maybe(st.sampled_from(["user", "assistant"])), "content": _json}),
            max_size=2)),
        "system": _json, "stop_sequences": _json, "temperature": _json, "top_p": _json,
        "stream": _maybe(st.booleans()), "tools": _maybe(st.just(MESSAGES_TOOLS)),
        "tool_choice": _json, "output_config": _json,
    },
)  # fmt: skip
_raw = st.binary(max_size=40) | st.just(b"") | st.just(b"[1]") | st.just(b'{"model": ')


def _check_reply(status: int, reply: object, anthropic_shape: bool) -> None:
    assert status < 500, reply
    if status < 400:
        return
    assert isinstance(reply, dict), reply
    if anthropic_shape:
        assert reply["type"] == "error" and set(reply["error"]) == {"type", "message"}, reply
        assert isinstance(reply["error"]["message"], str)
    else:
        assert set(reply["error"]) == {"message", "type", "param", "code"}, reply
        assert isinstance(reply["error"]["message"], str)


FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))  # fmt: skip


@FUZZ
@given(body=_responses_body, raw=st.none() | _raw)
def test_fuzzed_responses_bodies(deployment: Deployment, body: dict, raw: bytes | None) -> None:
    status, _, reply = http_json(deployment.http_port, "POST", "/v1/responses", body,
                                 headers=deployment.headers, raw=raw)  # fmt: skip
    _check_reply(status, reply, False)


@FUZZ
@given(body=_messages_body, raw=st.none() | _raw)
def test_fuzzed_messages_bodies(deployment: Deployment, body: dict, raw: bytes | None) -> None:
    path = "/v1/messages"
    status, _, reply = http_json(deployment.http_port, "POST", path, body,
                                 headers=deployment.headers, raw=raw)  # fmt: skip
    _check_reply(status, reply, True)
    status, _, reply = http_json(deployment.http_port, "POST", path + "/count_tokens", body,
                                 headers=deployment.headers, raw=raw)  # fmt: skip
    _check_reply(status, reply, True)
