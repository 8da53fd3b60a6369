"""Pure unit tests of the Responses and Messages JSON layers and the Responses store: input items
and content blocks become the right chat messages, bad bodies name their field, the event
writers emit the documented sequences, the store evicts by size (LRU) and by TTL and counts it."""

from __future__ import annotations

import json

import pytest

from service.api import anthropic_json, responses_json
from service.generation.errors import ValidationError
from service.generation.openai import (
    ChatMessage,
    ChoiceDelta,
    OpenAIEndpoints,
    ToolCall,
    ToolCallChunk,
    Usage,
    UsageChunk,
)
from service.generation.response_store import EVICT_SIZE, EVICT_TTL, ResponseStore
from service.generation.responses import ResponsesEndpoints, StoredResponse


def _body(**fields: object) -> bytes:
    return json.dumps({"model": "tgi", **fields}).encode()


def test_responses_input_items_become_chat_messages() -> None:
    decoded = responses_json.create_request(_body(input=[
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": '{"a":1}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ], tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"}, max_output_tokens=7))  # fmt: skip
    chat = decoded.request.chat
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[2].tool_calls == (ToolCall("call_1", "f", "{}"),
                                           ToolCall("call_2", "g", '{"a":1}'))  # fmt: skip
    assert chat.messages[3] == ChatMessage("tool", "42", tool_call_id="call_1")
    assert chat.tool_choice is not None and chat.tool_choice.function == "f"
    assert chat.params.max_tokens == 7 and not decoded.stream
    assert responses_json.create_request(_body(input="x")).request.chat.messages == (
        ChatMessage("user", "x"),
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": 3}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "image", "image_url": "x"}]}, "input[0].type"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}},
         "text.format.schema"),
        ({"input": "x", "store": "yes"}, "store"),
        ({"input": "x", "model": 5}, "model"),
    ],
)
def test_responses_bad_bodies_name_the_field(fields: dict, param: str) -> None:
    with pytest.raises(ValidationError) as caught:
        responses_json.create_request(_body(**fields))
    assert caught.value.field == param


def test_messages_blocks_become_chat_messages() -> None:
    decoded = anthropic_json.messages_request(_body(
        system=[{"type": "text", "text": "sys"}], max_tokens=5, stop_sequences=["END"],
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": ""},
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "text", "text": "thanks"}]},
        ],
        tools=[{"name": "w", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}))  # fmt: skip
    chat = decoded.chat
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[2].content == "calling"
    assert chat.messages[2].tool_calls == (ToolCall("toolu_1", "w", '{"city": "Paris"}'),)
    assert chat.messages[3] == ChatMessage("tool", "sunny", tool_call_id="toolu_1")
    assert chat.tool_choice is not None and chat.tool_choice.mode == "required"
    assert not chat.parallel_tool_calls and chat.params.stop == ("END",)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 5, "messages": []}, "messages"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
         "messages[0].content[0].type"),
        # an image block (accepted since image input) whose source is missing
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
         "messages[0].content[0].source.type"),
        ({"max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]},
         "temperature"),
        ({"max_tokens": 5, "top_k": 5, "messages": [{"role": "user", "content": "x"}]}, "top_k"),
        ({"max_tokens": 5, "tool_choice": {"type": "any"},
          "messages": [{"role": "user", "content": "x"}]}, "tool_choice"),
    ],
)
def test_messages_bad_bodies_name_the_field(fields: dict, param: str) -> None:
    with pytest.raises(ValidationError) as caught:
        anthropic_json.messages_request(_body(**fields))
    assert caught.value.field == param


def _events(data: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in data.decode().strip().split("\n\n"):
        kind, payload = block.split("\n")
        assert payload.startswith("data: ")
        out.append((kind.removeprefix("event: "), json.loads(payload[6:])))
    return out


def test_responses_event_writer_sequence() -> None:
    writer = responses_json.EventWriter("resp_1", "m", {"store": True}, 0)
    data = writer.start()
    data += writer.push(ChoiceDelta(0, "", first=True))
    data += writer.push(ChoiceDelta(0, "", reasoning="think"))
    data += writer.push(ChoiceDelta(0, "Hel"))
    data += writer.push(ChoiceDelta(0, "lo"))
    data += writer.push(ChoiceDelta(0, "", tool_calls=(ToolCallChunk(0, "call_9", "f", '{"a"'),)))
    data += writer.push(ChoiceDelta(0, "", tool_calls=(ToolCallChunk(0, None, None, ':1}'),)))
    data += writer.push(ChoiceDelta(0, "", finish_reason="tool_calls"))
    data += writer.push(UsageChunk(Usage(3, 4)))
    events = _events(data)
    kinds = [k for k, _ in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert all(e["type"] == k for k, e in events)
    final = events[-1][1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert final["output"][1]["content"][0]["text"] == "Hello"
    assert final["output"][2]["arguments"] == '{"a":1}' and final["usage"]["total_tokens"] == 7
    assert writer.final == final and writer.text == "Hello"
    assert writer.calls == [ToolCall("call_9", "f", '{"a":1}')]


def test_messages_event_writer_sequence_and_stop_reason() -> None:
    writer = anthropic_json.EventWriter("msg_1", "m", 5)
    data = writer.start() + writer.push(ChoiceDelta(0, "", first=True))
    data += writer.push(ChoiceDelta(0, "", reasoning="hm"))
    data += writer.push(ChoiceDelta(0, "ok"))
    data += writer.push(ChoiceDelta(0, "", finish_reason="stop", stop_sequence="END"))
    data += writer.push(UsageChunk(Usage(5, 2)))
    events = _events(data)
    assert [k for k, _ in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert events[0][1]["message"]["usage"]["input_tokens"] == 5
    assert events[1][1]["content_block"]["type"] == "thinking"
    assert events[2][1]["delta"] == {"type": "thinking_delta", "thinking": "hm"}
    assert events[6][1] == {"type": "content_block_delta", "index": 1,
                            "delta": {"type": "text_delta", "text": "ok"}}  # fmt: skip
    assert events[8][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert events[8][1]["usage"] == {"output_tokens": 2}


def test_messages_event_writer_streams_tool_arguments() -> None:
    writer = anthropic_json.EventWriter("msg_1", "m", 5)
    data = writer.push(ChoiceDelta(0, "", tool_calls=(ToolCallChunk(0, "call_1", "f", ""),)))
    data += writer.push(ChoiceDelta(0, "", tool_calls=(ToolCallChunk(0, None, None, '{"a":'),)))
    data += writer.push(ChoiceDelta(0, "", tool_calls=(ToolCallChunk(0, None, None, "1}"),)))
    data += writer.push(ChoiceDelta(0, "", finish_reason="tool_calls"))
    data += writer.push(UsageChunk(Usage(5, 3)))
    events = _events(data)
    assert events[0][1]["content_block"] == {"type": "tool_use", "id": "toolu_1", "name": "f",
                                             "input": {}}  # fmt: skip
    pieces = [e["delta"]["partial_json"] for k, e in events if k == "content_block_delta"]
    assert pieces == ['{"a":', "1}"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_store_evicts_least_recently_used_then_expires() -> None:
    now = [0.0]
    evicted: list[str] = []
    store: ResponseStore[int] = ResponseStore(2, 10.0, clock=lambda: now[0],
                                              on_evict=evicted.append)  # fmt: skip
    store.put("a", 1)
    store.put("b", 2)
    assert store.get("a") == 1  # a is now the most recently used
    store.put("c", 3)
    assert store.get("b") is None and store.get("a") == 1 and store.get("c") == 3
    assert evicted == [EVICT_SIZE]
    now[0] = 10.0
    assert store.get("a") is None and len(store) == 0
    assert evicted == [EVICT_SIZE, EVICT_TTL, EVICT_TTL]
    store.put("d", 4)
    assert store.delete("d") and not store.delete("d")
    off: ResponseStore[int] = ResponseStore(0, 1.0)
    off.put("x", 1)
    assert off.get("x") is None


def test_previous_response_id_prepends_the_stored_conversation() -> None:
    store: ResponseStore[StoredResponse] = ResponseStore(4, 60.0)
    endpoints = ResponsesEndpoints(object.__new__(OpenAIEndpoints), store)
    earlier = (ChatMessage("user", "hi"), ChatMessage("assistant", "hello"))
    store.put("resp_1", StoredResponse(earlier, {}))
    decoded = responses_json.create_request(
        _body(input="again", previous_response_id="resp_1", instructions="terse")
    )
    conversation = endpoints.conversation(decoded.request)
    assert conversation == (*earlier, ChatMessage("user", "again"))
    chat = endpoints.chat_request(decoded.request, conversation)
    assert chat.messages[0] == ChatMessage("system", "terse") and chat.messages[1:] == conversation
    missing = responses_json.create_request(_body(input="x", previous_response_id="resp_2"))
    with pytest.raises(ValidationError) as caught:
        endpoints.conversation(missing.request)
    assert caught.value.field == "previous_response_id"


def test_unary_bodies_carry_reasoning_and_calls() -> None:
    from service.generation.openai import Choice, Completed, ResponseHeader

    call = ToolCall("call_7", "f", '{"a": 1}')
    choice = Choice(0, "", "tool_calls", None, (call,), reasoning="why")
    completed = Completed(ResponseHeader("chatcmpl-1", 0, "m", "fp"), (choice,), Usage(4, 6))
    body = responses_json.response_body("resp_1", {"store": True}, completed)
    assert [i["type"] for i in body["output"]] == ["reasoning", "function_call"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "why"}]
    assert body["output"][1]["call_id"] == "call_7" and body["status"] == "completed"
    message = json.loads(anthropic_json.message_body("msg_1", completed))
    assert message["content"] == [
        {"type": "thinking", "thinking": "why", "signature": ""},
        {"type": "tool_use", "id": "toolu_7", "name": "f", "input": {"a": 1}},
    ]
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {"input_tokens": 4, "output_tokens": 6}
