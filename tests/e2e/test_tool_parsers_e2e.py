"""Tool calls of each family's format end to end: `tokenwire launch` on the tiny random model
with --tool-call-parser, the official `openai` client through the real Envoy. The format's
grammar forces calls (tool_choice required / named), the router parses them back, and the
SDK's own stream accumulator (`client.chat.completions.stream`) reassembles the streamed
tool-call deltas into the same calls as the unary answer. The tools take only bounded values
(enums, ranged integers, booleans; no other keys), so a random model's calls always close within max_tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.helpers.processes import Deployment, launch

pytestmark = pytest.mark.slow

MODE = {
    "type": "function",
    "function": {
        "name": "set_mode",
        "description": "Sets the machine's mode.",
        "parameters": {
            "type": "object",
            "properties": {
                "mode": {"type": "string", "enum": ["fast", "slow"]},
                "level": {"type": "integer", "minimum": 0, "maximum": 99},
                "on": {"type": "boolean"},
            },
            "required": ["mode", "level", "on"],
            "additionalProperties": False,
        },
    },
}
PING = {
    "type": "function",
    "function": {
        "name": "ping",
        "parameters": {"type": "object", "properties": {
            "times": {"type": "integer", "minimum": 1, "maximum": 3}}, "required": ["times"],
            "additionalProperties": False},
    },
}  # fmt: skip
TOOLS = [MODE, PING]
ASK = [{"role": "user", "content": "Set the machine to fast mode, level 7."}]


# Two formats, to keep the launches few: JSON arguments (auto: the tiny model's template teaches
# no format, so hermes) and Qwen3-Coder's XML, whose string values stream character by character.
# (llama3_json, mistral and pythonic pass the same test when added here.)
@pytest.fixture(scope="module", params=["auto", "qwen3_coder"])
def deployment(request, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    dep = launch(tmp_path_factory.mktemp("tools"), "--tool-call-parser", request.param)
    yield dep
    code = dep.stop()
    assert code == 0, dep.log()


@pytest.fixture(scope="module")
def client(deployment: Deployment) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://{deployment.envoy_target}/v1", api_key="unused", max_retries=0
    )


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "set_mode"}}],
    ids=["required", "named"],
)
def test_streamed_tool_call_deltas_reassemble_into_the_unary_calls(
    client: openai.OpenAI, tool_choice
) -> None:
    # One call (a random model given room for several would call until max_tokens).
    kwargs = {"model": "tgi", "messages": ASK, "tools": TOOLS, "tool_choice": tool_choice,
              "parallel_tool_calls": False, "temperature": 0, "max_tokens": 200}  # fmt: skip
    unary = client.chat.completions.create(**kwargs).choices[0]
    assert unary.finish_reason == "tool_calls", repr(unary.message.content)
    calls = _calls(unary.message)
    assert len(calls) == 1 and unary.message.tool_calls[0].id
    if isinstance(tool_choice, dict):
        assert calls[0][0] == "set_mode"
    for name, arguments in calls:
        assert name in ("set_mode", "ping")
        if name == "set_mode":
            assert arguments["mode"] in ("fast", "slow") and 0 <= arguments["level"] <= 99
            assert isinstance(arguments["on"], bool)

    pieces: dict[int, int] = {}  # call index -> chunks that carried some of its arguments
    with client.chat.completions.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                for delta in event.chunk.choices[0].delta.tool_calls or []:
                    if delta.function and delta.function.arguments:
                        pieces[delta.index] = pieces.get(delta.index, 0) + 1
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert _calls(final.message) == calls  # the SDK's accumulator rebuilt the same calls
    if isinstance(tool_choice, dict):
        # set_mode's arguments arrived in several chunks (streamed as generated, not only when
        # the call closed).
        assert pieces[0] >= 2, pieces
