"""Chat completions through the output parsers, on a scripted engine: the reasoning comes back
as message.reasoning_content / streamed delta.reasoning_content, a format's special marker
token (Mistral's `[TOOL_CALLS]`) is read although other special tokens are dropped, tool calls
stream as pieces that the `openai` SDK's own chunk accumulator joins into the unary calls, and
the grammar a tool_choice asks for starts after `</think>`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from service.api import openai_json
from service.engine.contracts import FinishReason
from service.generation.grammar import FunctionTool
from service.generation.openai import (
    ChatMessage,
    ChatRequest,
    ChoiceDelta,
    OpenAIEndpoints,
    OutputParsers,
    SamplingRequest,
    ToolChoice,
)
from service.generation.parsers.registry import reasoning_parser, tool_call_parser
from service.generation.service import GeneratedSequence, GenerateOutcome, StreamItem
from service.generation.validation import GenerateInput
from service.scheduler.contracts import TokenInfo

PROMPT = "<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n<think>\n"
# (text, special) of each generated token: reasoning, then a Mistral v11 call whose marker is
# one special token, then the end-of-sequence token.
TOKENS = [
    ("The user", False), (" wants Oslo.", False), ("\n</think>", False), ("\n\n", False),
    ("[TOOL_CALLS]", True), ("get_weather", False), ("[ARGS]", True), ('{"city', False),
    ('": "Os', False), ('lo"}', False), ("</s>", True),
]  # fmt: skip
WEATHER = FunctionTool("get_weather", None, {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})  # fmt: skip


@dataclass
class ScriptedService:
    """What OpenAIEndpoints uses of a GenerationService, answering TOKENS."""

    seen: list[GenerateInput] = field(default_factory=list)
    validator: Any = field(
        default_factory=lambda: SimpleNamespace(limits=SimpleNamespace(max_best_of=1))
    )

    def adapters(self) -> list[Any]:
        return []

    def _tokens(self) -> list[TokenInfo]:
        return [TokenInfo(i, text, -0.5, special) for i, (text, special) in enumerate(TOKENS)]

    async def generate(self, request: GenerateInput, **_: Any) -> GenerateOutcome:
        self.seen.append(request)
        tokens = tuple(self._tokens())
        text = "".join(t.text for t in tokens if not t.special)
        seq = GeneratedSequence(text, FinishReason.EOS_TOKEN, len(tokens), None, (), tokens, ())
        return GenerateOutcome(seq, (), SimpleNamespace(input_length=7))

    async def stream(self, request: GenerateInput, **_: Any) -> AsyncIterator[StreamItem]:
        self.seen.append(request)
        tokens = self._tokens()
        options = SimpleNamespace(input_length=7)
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            finished = (
                SimpleNamespace(finish_reason=FinishReason.EOS_TOKEN, generated_tokens=len(tokens))
                if last else None
            )  # fmt: skip
            yield StreamItem(0, token, (), options, finished=finished)  # type: ignore[arg-type]


class FixedTemplate:
    async def render(self, messages: Any, tools: Any) -> tuple[str, tuple[int, ...]]:
        return PROMPT, (1, 2, 3, 4, 5, 6, 7)


@pytest.fixture
def endpoints() -> tuple[OpenAIEndpoints, ScriptedService]:
    service = ScriptedService()
    parsers = OutputParsers(reasoning_parser("think"), tool_call_parser("mistral"),
                            {"[TOOL_CALLS]": 5, "[ARGS]": 6})  # fmt: skip
    ep = OpenAIEndpoints(service, model_id="m", system_fingerprint="fp",  # type: ignore[arg-type]
                         chat_template=FixedTemplate(), parsers=parsers)  # type: ignore[arg-type]
    return ep, service


REQUEST = ChatRequest(
    (ChatMessage("user", "Weather in Oslo?"),),
    SamplingRequest("m", max_tokens=50, temperature=0),
    tools=(WEATHER,),
    tool_choice=ToolChoice("required"),
)


async def test_unary_reasoning_and_a_call_behind_a_special_marker(endpoints) -> None:
    ep, service = endpoints
    completed = await ep.chat(REQUEST, request_id="r1", deadline=None)
    (choice,) = completed.choices
    assert choice.reasoning == "The user wants Oslo.\n"
    assert choice.finish_reason == "tool_calls" and choice.text == ""
    (call,) = choice.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    assert len(call.id) == 9  # Mistral's ids
    # The tools' grammar: free text until </think>, then the calls, [TOOL_CALLS] as its token.
    spec = service.seen[0].grammar_spec
    assert spec.kind == "lark" and spec.source.startswith("start: THOUGHT answer")
    assert "<[5]>" in spec.source and "<[6]>" in spec.source
    body = json.loads(openai_json.chat_completion(completed))
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants Oslo.\n"
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == (
        "get_weather"
    )


async def test_stream_deltas_reassemble_with_the_sdk_accumulator(endpoints) -> None:
    ep, _ = endpoints
    header, events = await ep.chat_stream(REQUEST, request_id="r2", deadline=None)
    state = ChatCompletionStreamState()
    reasoning, argument_chunks = [], 0
    async for event in events:
        assert isinstance(event, ChoiceDelta)
        raw = openai_json.chat_chunk(header, event, False)
        chunk = ChatCompletionChunk.model_validate_json(raw[len(b"data: ") :])
        state.handle_chunk(chunk)
        delta = json.loads(raw[len(b"data: ") :])["choices"][0]["delta"]
        reasoning.append(delta.get("reasoning_content", ""))
        argument_chunks += bool(event.tool_calls and event.tool_calls[0].arguments)
    final = state.get_final_completion().choices[0]
    assert "".join(reasoning) == "The user wants Oslo.\n"
    assert final.finish_reason == "tool_calls"
    (call,) = final.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Oslo"})  # fmt: skip
    assert argument_chunks == 3  # one per generated piece of the arguments, not at the end
    unary = (await ep.chat(REQUEST, request_id="r3", deadline=None)).choices[0]
    assert unary.tool_calls[0].arguments == call.function.arguments
