"""The OpenAI routes' pure parts: request decoding, byte-exact encoding, error bodies, stop-string
trimming, and the HttpBody servicer's error paths (before and after the first chunk)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from google.api.httpbody_pb2 import HttpBody

from service.api import openai_json
from service.api.openai_servicer import OpenAIServicer
from service.engine.contracts import OverloadedError, ShardUnavailableError
from service.generation.errors import ModelNotFoundError, UnauthenticatedError, ValidationError
from service.generation.openai import (
    ChoiceDelta,
    ResponseHeader,
    StopTrimmer,
    Usage,
    UsageChunk,
    cut_at_stop,
)

HEADER = ResponseHeader("chatcmpl-1", 1700000000, "m", "tokenwire-0")


def body(**fields: object) -> bytes:
    base: dict[str, object] = {"model": "tgi", "messages": [{"role": "user", "content": "hi"}]}
    base.update(fields)
    return json.dumps(base).encode()


def test_chat_request_decodes_openai_fields_and_ignores_unknown_ones() -> None:
    request = openai_json.chat_request(
        body(
            stop="\n",
            max_tokens=7,
            max_completion_tokens=5,
            temperature=0,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=2,
            user="u",
            some_future_field={"x": 1},
            messages=[
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
        )
    )
    p = request.params
    assert p.stop == ("\n",) and p.max_tokens == 5 and p.temperature == 0.0 and p.seed == 3
    assert p.stream and p.include_usage and p.logprobs and p.top_logprobs == 2
    assert [(m.role, m.content) for m in request.messages] == [("system", "be brief"), ("user", "ab")]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"stop": [1]}, "stop"),
        ({"n": 1.5}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools[0].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
         "messages[0].content[0].type"),
        ({"model": None}, "model"),
    ],
)  # fmt: skip
def test_bad_fields_are_named(fields: dict[str, object], param: str) -> None:
    with pytest.raises(ValidationError) as caught:
        openai_json.chat_request(body(**fields))
    assert caught.value.field == param


def test_text_response_format_and_empty_tools_are_accepted() -> None:
    openai_json.chat_request(body(response_format={"type": "text"}, tools=[], logit_bias={}))


def test_stream_chunks_are_byte_exact() -> None:
    first = openai_json.chat_chunk(HEADER, ChoiceDelta(0, "", first=True), True)
    assert first == (
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,'
        b'"model":"m","system_fingerprint":"tokenwire-0","choices":[{"index":0,"delta":'
        b'{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
        b'"usage":null}\n\n'
    )
    last = openai_json.chat_chunk(HEADER, ChoiceDelta(0, "", finish_reason="length"), False)
    assert json.loads(last[6:])["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    usage = json.loads(openai_json.chat_chunk(HEADER, UsageChunk(Usage(3, 4)), True)[6:])
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
    }


@pytest.mark.parametrize(
    ("error", "status", "param", "code"),
    [
        (ValidationError("top_p", "top_p must be in (0, 1]"), 400, "top_p", None),
        (ValidationError("messages", "messages must have at most 9 tokens"), 400, "messages",
         "context_length_exceeded"),
        (ModelNotFoundError("no such model"), 404, "model", "model_not_found"),
        (UnauthenticatedError("bad key"), 401, None, "invalid_api_key"),
        (OverloadedError("busy"), 429, None, "rate_limit_exceeded"),
        (ShardUnavailableError("down"), 503, None, "service_unavailable"),
        (RuntimeError("bug"), 500, None, None),
    ],
)  # fmt: skip
def test_error_bodies_have_openai_shape_and_status(
    error: Exception, status: int, param: str | None, code: str | None
) -> None:
    got_status, raw = openai_json.error_body(error)
    assert got_status == status
    assert json.loads(raw) == {
        "error": {
            "message": json.loads(raw)["error"]["message"],
            "type": json.loads(raw)["error"]["type"],
            "param": param,
            "code": code,
        }
    }
    if isinstance(error, RuntimeError):
        assert "bug" not in raw.decode()  # internals are not echoed


def test_stop_trimmer_holds_back_possible_stop_prefixes() -> None:
    trimmer = StopTrimmer(("\nUser:",))
    out = [trimmer.push(t) for t in ["Hello", " there", "\n", "Us", "er:", " more"]]
    assert "".join(out) == "Hello there"
    assert out[2] == "" and trimmer.stopped
    false_alarm = StopTrimmer(("\nUser:",))
    sent = "".join(false_alarm.push(t) for t in ["a", "\nUs", "ually"]) + false_alarm.flush()
    assert sent == "a\nUsually"
    assert cut_at_stop("The capital of France is Paris.", (" Paris", "is")) == 22


class _Context:
    def time_remaining(self) -> float | None:
        return None


class _FailingEndpoints:
    """chat_stream yields one chunk, then the shard fails."""

    async def chat_stream(self, request, *, request_id, deadline):  # type: ignore[no-untyped-def]
        async def events() -> AsyncIterator[ChoiceDelta]:
            yield ChoiceDelta(0, "", first=True)
            raise ShardUnavailableError("the shard died")

        return HEADER, events()

    async def chat(self, request, *, request_id, deadline):  # type: ignore[no-untyped-def]
        raise OverloadedError("too many requests in flight")


async def _bodies(data: bytes) -> list[HttpBody]:
    servicer = OpenAIServicer()
    servicer.attach(_FailingEndpoints())  # type: ignore[arg-type]
    return [b async for b in servicer.ChatCompletions(HttpBody(data=data), _Context())]  # type: ignore[arg-type]


def test_a_stream_failing_after_its_first_chunk_ends_with_an_error_event_then_done() -> None:
    bodies = asyncio.run(_bodies(body(stream=True)))
    assert all(b.content_type == "text/event-stream" for b in bodies)
    events = b"".join(b.data for b in bodies).decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    error = json.loads(events[-3].removeprefix("data: "))["error"]
    assert error["message"] == "the shard died" and error["code"] == "service_unavailable"


def test_an_error_before_the_first_chunk_is_one_json_error_body() -> None:
    (only,) = asyncio.run(_bodies(body()))
    assert only.content_type == "application/json"
    assert json.loads(only.data)["error"]["code"] == "rate_limit_exceeded"


@pytest.fixture(scope="module")
def template_free_model(tmp_path_factory: pytest.TempPathFactory):
    """The tiny model with the chat template removed from its tokenizer_config.json."""
    from shard.tools.tiny_model import TinyModelSpec, make_tiny_model

    out = make_tiny_model(
        tmp_path_factory.mktemp("no-template") / "model", TinyModelSpec(arch="llama")
    )
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def test_a_model_without_a_chat_template_answers_400_saying_so(template_free_model) -> None:
    from service.generation.chat_template import ChatTemplate
    from service.generation.openai import ChatMessage

    template = ChatTemplate(template_free_model)
    try:
        with pytest.raises(ValidationError) as caught:
            asyncio.run(template.render((ChatMessage("user", "hi"),)))
    finally:
        template.close()
    assert caught.value.field == "messages"
    assert "no chat template" in str(caught.value) and "--chat-template" in str(caught.value)


def test_chat_template_file_overrides_and_ids_match_the_text(template_free_model, tmp_path) -> None:
    from service.generation.chat_template import ChatTemplate
    from service.generation.openai import ChatMessage

    path = tmp_path / "t.jinja"
    path.write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    template = ChatTemplate(template_free_model, path)
    try:
        prompt, ids = asyncio.run(
            template.render((ChatMessage("system", "s"), ChatMessage("user", "u")))
        )
    finally:
        template.close()
    assert prompt == "[system] s\n[user] u\n[assistant] "
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(template_free_model / "tokenizer.json"))
    assert list(ids) == tokenizer.encode(prompt, add_special_tokens=False).ids
