"""Structured output on the router side: the grammar compiler (llguidance against a real
tokenizer; errors name the field; cached by content; off the event loop), OpenAI's
response_format / tools decoding and encoding, the tool-call parser and stream splitter, and the
chat-template rendering of tool conversations."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

from service.api import openai_json
from service.engine.contracts import GrammarSpec
from service.generation.chat_template import _tools_as_text
from service.generation.errors import ValidationError
from service.generation.grammar import (
    FunctionTool,
    GrammarCompiler,
    json_schema_spec,
)
from service.generation.openai import (
    Choice,
    ChoiceDelta,
    Completed,
    ResponseHeader,
    ToolCall,
    ToolCallChunk,
    Usage,
)
from service.generation.parsers.hermes import HermesParser

HEADER = ResponseHeader("chatcmpl-1", 1700000000, "m", "fp")
ADD = FunctionTool("add", "adds", {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]})


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: pytest.TempPathFactory):
    from tests.helpers.models import tiny_model

    model_dir = tiny_model(tmp_path_factory, "llama")
    config = json.loads((model_dir / "config.json").read_text())
    c = GrammarCompiler(Path(model_dir), config["vocab_size"], config["eos_token_id"])
    yield c
    c.close()


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (GrammarSpec("regex", "(?=a)b"), "cannot be compiled"),
        (json_schema_spec({"type": "strin"}), "cannot be compiled"),
        (json_schema_spec({"type": "integer", "minimum": 5, "maximum": 1}), "parameters.grammar"),
        (json_schema_spec({"allOf": [{"type": "string"}, {"type": "integer"}]}),
         "parameters.grammar"),
        (json_schema_spec({"type": "object", "uniqueKeys": 3, "minProperties": "x"}),
         "parameters.grammar"),
    ],
    ids=["lookahead", "unknown_type", "empty_range", "no_common_type", "bad_keyword"],
)
async def test_bad_grammars_are_validation_errors_naming_the_field(compiler, spec, says):
    with pytest.raises(ValidationError) as caught:
        await compiler.check(spec, "parameters.grammar")
    assert caught.value.field == "parameters.grammar"
    assert str(caught.value).startswith("parameters.grammar ") and says in str(caught.value)


async def test_good_grammars_compile_once_off_the_event_loop(compiler, monkeypatch):
    calls: list[str] = []
    compile_sync = compiler.compile_sync

    def counted(spec):
        calls.append(threading.current_thread().name)
        return compile_sync(spec)

    monkeypatch.setattr(compiler, "compile_sync", counted)
    spec = json_schema_spec({"type": "object", "properties": {"x": {"type": "integer"}}})
    await asyncio.gather(*(compiler.check(spec, "f") for _ in range(5)))
    await compiler.check(spec, "f")
    await compiler.check(GrammarSpec("regex", "[a-z]+"), "f")
    hermes = HermesParser().grammar((ADD,), required=False, parallel=True, special_ids={})
    await compiler.check(hermes, "tools")
    assert len(calls) == 3  # the repeated schema compiled once
    assert all(name.startswith("grammar-compile") for name in calls)


def test_openai_request_fields_decode() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "add"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": "{\"a\": 1, \"b\": 2}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
        ],
        "tools": [{"type": "function", "function": {"name": "add", "parameters": ADD.parameters}}],
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        "parallel_tool_calls": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "object"}, "strict": True}},
    }
    request = openai_json.chat_request(json.dumps(body).encode())
    assert request.messages[1].tool_calls == (ToolCall("c1", "add", '{"a": 1, "b": 2}'),)
    assert request.messages[2].tool_call_id == "c1"
    assert request.tools[0].name == "add" and request.tool_choice.function == "add"
    assert request.parallel_tool_calls is False
    assert request.response_format.schema == {"type": "object"} and request.response_format.strict
    with pytest.raises(ValidationError) as caught:
        openai_json.chat_request(json.dumps({**body, "tool_choice": {
            "type": "function", "function": {"name": "mul"}}}).encode())
    assert caught.value.field == "tool_choice"


def test_tool_calls_encode_as_openai_writes_them() -> None:
    call = ToolCall("call_1", "add", '{"a": 1}')
    body = json.loads(openai_json.chat_completion(Completed(
        HEADER, (Choice(0, "", "tool_calls", None, (call,)),), Usage(3, 4))))
    message = body["choices"][0]["message"]
    assert message["content"] is None and body["choices"][0]["finish_reason"] == "tool_calls"
    assert message["tool_calls"] == [{"id": "call_1", "type": "function",
                                      "function": {"name": "add", "arguments": '{"a": 1}'}}]
    # Streamed: the first piece names the call, the next ones only add arguments.
    first = ToolCallChunk(0, "call_1", "add", '{"a"')
    more = ToolCallChunk(0, None, None, ": 1}")
    deltas = [
        json.loads(openai_json.chat_chunk(HEADER, ChoiceDelta(0, "", tool_calls=(c,)), False)[
            len(b"data: "):])["choices"][0]["delta"]["tool_calls"][0]
        for c in (first, more)
    ]  # fmt: skip
    assert deltas[0] == {"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "add", "arguments": '{"a"'}}  # fmt: skip
    assert deltas[1] == {"index": 0, "function": {"arguments": ": 1}"}}
    # Reasoning: message.reasoning_content and delta.reasoning_content; text beside calls stays.
    body = json.loads(openai_json.chat_completion(Completed(
        HEADER, (Choice(0, "Checking.", "tool_calls", None, (call,), "think"),), Usage(3, 4))))
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "think" and message["content"] == "Checking."
    chunk = openai_json.chat_chunk(HEADER, ChoiceDelta(0, "", reasoning="hmm"), False)
    assert json.loads(chunk[len(b"data: "):])["choices"][0]["delta"] == {
        "reasoning_content": "hmm"}


def test_templates_without_tool_support_get_tools_as_text() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD.parameters}}]
    messages = [
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": "", "tool_calls": [], "_blocks": "<tool_call>\nX\n"
         "</tool_call>"},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    out = _tools_as_text(messages, tools)
    assert out[0]["role"] == "system" and '"name": "add"' in out[0]["content"]
    assert out[2]["content"] == "<tool_call>\nX\n</tool_call>"
    assert out[3]["content"] == "<tool_response>\n3\n</tool_response>"
    assert all("tool_calls" not in m and "_blocks" not in m for m in out)


async def test_a_tokenizer_llguidance_cannot_read_disables_grammars_only(tmp_path: Path):
    from service.generation.errors import UnsupportedError
    from shard.testing.checkpoint import write_tokenizer

    write_tokenizer(tmp_path, 128256)  # word-level with a WordPiece decoder
    compiler = GrammarCompiler(tmp_path, 128256, 128001)
    await compiler.ready()  # logs, does not raise
    with pytest.raises(UnsupportedError, match="parameters.grammar"):
        await compiler.check(GrammarSpec("regex", "a+"), "parameters.grammar")
    compiler.close()
