"""Output parsers on recorded outputs of each family's format (written from the formats' own
documentation: Hermes / Qwen2.5 `<tool_call>` blocks, Llama 3.1 JSON calls, Mistral's
`[TOOL_CALLS]` in both tokenizer layouts, Qwen3-Coder's XML, Llama 3.2 / 4 pythonic lists, and
the `<think>` reasoning of Qwen3 / DeepSeek-R1 / SmolLM3).

Every case is parsed whole and streamed split at every possible boundary (two pieces, and one
character at a time): the streamed deltas must reassemble to the whole parse, each call's
argument deltas must join to its arguments, and a call that never closes comes back as text.
Each format's grammar is compiled with llguidance against a real tokenizer and must accept the
recorded calls and reject a broken one."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.generation.grammar import FunctionTool, json_schema_spec
from service.generation.parsers.contracts import (
    ContentDelta,
    OutputDelta,
    ParsedOutput,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from service.generation.parsers.pipeline import OutputStream, collect, parse_output
from service.generation.parsers.registry import (
    reasoning_parser,
    tool_call_parser,
    tool_format_of_template,
)

WEATHER = FunctionTool("get_weather", "Weather of a city", {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "metric": {"type": "boolean"}},
    "required": ["city"],
})  # fmt: skip
TIME = FunctionTool("get_time", None, {"type": "object", "properties": {}})
TOOLS = (WEATHER, TIME)

# (parser, output, expected content, expected calls as (name, arguments dict))
Calls = list[tuple[str, dict[str, Any]]]
CASES: list[tuple[str, str, str, Calls]] = [
    # --- hermes (Qwen2.5 / Qwen3 / Hermes 3) ---
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Paris", "days": 2})],
    ),
    (
        "hermes",
        (
            'I\'ll check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Caf\u00e9 {x}\\"y"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
            '"arguments": {}}\n</tool_call>'
        ),
        "I'll check both.\n",
        [("get_weather", {"city": 'Caf\u00e9 {x}"y'}), ("get_time", {})],
    ),
    (
        "hermes",
        '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>',
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        "hermes",
        "The weather is fine, no <tool_call needed.",
        "The weather is fine, no <tool_call needed.",
        [],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        [],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n',
        [],
    ),
    # --- llama3_json (Llama 3.1 / 3.2 / 3.3) ---
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "metric": true}}',
        "",
        [("get_weather", {"city": "Paris", "metric": True})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}; '
        '{"name": "get_time", "parameters": {}}',
        "",
        [("get_weather", {"city": "Lima"}), ("get_time", {})],
    ),
    ("llama3_json", "It is sunny in {Paris} today.", "It is sunny in {Paris} today.", []),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Pa',
        '{"name": "get_weather", "parameters": {"city": "Pa',
        [],
    ),
    # --- mistral, tokenizer < v11 and v11+ ---
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    (
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Nice", "days": 3}[TOOL_CALLS]get_time[ARGS]{}',
        "Sure.",
        [("get_weather", {"city": "Nice", "days": 3}), ("get_time", {})],
    ),
    ("mistral", "No tools [TOOLS] needed.", "No tools [TOOLS] needed.", []),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
        [],
    ),
    ("mistral", "[TOOL_CALLS]get_weather", "[TOOL_CALLS]get_weather", []),
    # --- qwen3_coder ---
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nfalse\n"
        "</parameter>\n</function>\n</tool_call>",
        "",
        [("get_weather", {"city": "San Francisco", "days": 3, "metric": False})],
    ),
    (
        "qwen3_coder",
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        'a <b> "c"\nd\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n'
        "<function=get_time>\n</function>\n</tool_call>",
        "Checking.\n",
        [("get_weather", {"city": 'a <b> "c"\nd'}), ("get_time", {})],
    ),
    (
        "qwen3_coder",
        "<tool_call><function=get_weather><parameter=city>Oslo</parameter>"
        "<parameter=days>4</parameter></function></tool_call>",
        "",
        [("get_weather", {"city": "Oslo", "days": 4})],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        [],
    ),
    # --- pythonic (Llama 3.2 / Llama 4) ---
    (
        "pythonic",
        '[get_weather(city="Paris", days=2, metric=True)]',
        "",
        [("get_weather", {"city": "Paris", "days": 2, "metric": True})],
    ),
    (
        "pythonic",
        "<|python_start|>[get_weather(city='Quito, EC'), get_time()]<|python_end|>",
        "",
        [("get_weather", {"city": "Quito, EC"}), ("get_time", {})],
    ),
    ("pythonic", "[1] says it will rain.", "[1] says it will rain.", []),
    ("pythonic", '[get_weather(city="Par', '[get_weather(city="Par', []),
]


def _split_streams(text: str) -> list[list[str]]:
    """The text in two pieces at every boundary, and one character at a time."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


def _stream(pieces: list[str], tool: str | None, prompt: str, reasoning: str = "none"
            ) -> list[OutputDelta]:  # fmt: skip
    parser = tool_call_parser(tool) if tool else None
    stream = OutputStream(reasoning_parser(reasoning), parser, prompt=prompt, tools=TOOLS)
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    return deltas + stream.finish()


def _shape(out: ParsedOutput) -> tuple[str | None, str, Calls]:
    return out.reasoning, out.content, [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def _check_call_deltas(deltas: list[OutputDelta]) -> None:
    """Each call: its start first, then argument deltas that join to its end's arguments."""
    started: dict[int, list[str]] = {}
    count = 0
    for d in deltas:
        if isinstance(d, ToolCallStart):
            assert d.index == count and d.id and d.name
            started[d.index], count = [], count + 1
        elif isinstance(d, ToolCallArgumentsDelta):
            assert d.index in started and d.text
            started[d.index].append(d.text)
        elif isinstance(d, ToolCallEnd):
            assert "".join(started.pop(d.index)) == d.arguments


@pytest.mark.parametrize(("tool", "text", "content", "calls"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])  # fmt: skip
def test_recorded_outputs_parse_whole_and_streamed_at_every_split(tool, text, content, calls):
    whole = parse_output(text, reasoning_parser("none"), tool_call_parser(tool), prompt="",
                         tools=TOOLS)  # fmt: skip
    assert _shape(whole) == (None, content, calls)
    for pieces in _split_streams(text):
        deltas = _stream(pieces, tool, "")
        _check_call_deltas(deltas)
        assert _shape(collect(deltas)) == (None, content, calls), pieces


def test_arguments_stream_as_they_are_generated() -> None:
    """A long argument reaches the client before the call closes (not only at its end)."""
    for tool, head in [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "'),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "'),
        ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n"),
    ]:
        stream = tool_call_parser(tool).start(TOOLS)
        first = stream.feed(head)
        assert [type(d) for d in first][:1] == [ToolCallStart], tool
        later = stream.feed("Llanfair")
        assert any(isinstance(d, ToolCallArgumentsDelta) and "Llanfair" in d.text
                   for d in later), (tool, later)  # fmt: skip


def test_an_unclosed_call_streams_then_ends_incomplete_with_its_source() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    deltas = _stream([text], "hermes", "")
    assert isinstance(deltas[0], ToolCallStart)
    end = deltas[-1]
    assert isinstance(end, ToolCallEnd) and not end.complete and end.source == text


# --- reasoning -------------------------------------------------------------------------------

REASONING_CASES: list[tuple[str, str, str | None, str]] = [
    # DeepSeek-R1: the template opens <think> in the prompt.
    (
        "<|Assistant|><think>\n",
        "Two plus two.\n</think>\n\nIt is 4.",
        "Two plus two.\n",
        "It is 4.",
    ),
    # Qwen3 / SmolLM3 thinking: the model opens it.
    (
        "<|im_start|>assistant\n",
        "<think>\nHmm </thin k>.\n</think>\n\nHi!",
        "\nHmm </thin k>.\n",
        "Hi!",
    ),
    # Qwen3 with thinking off: the template closes an empty block; the output is all answer.
    (
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "Hi <think> there",
        None,
        "Hi <think> there",
    ),
    ("<|im_start|>assistant\n", "Plain answer.", None, "Plain answer."),
    # Cut by max_tokens while reasoning: all reasoning, no answer.
    ("<think>\n", "Still thinking about </thi", "Still thinking about </thi", ""),
]


@pytest.mark.parametrize(("prompt", "text", "reasoning", "content"), REASONING_CASES)
def test_think_reasoning_split_whole_and_streamed(prompt, text, reasoning, content):
    whole = parse_output(text, reasoning_parser("think"), None, prompt=prompt)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for pieces in _split_streams(text):
        deltas = _stream(pieces, None, prompt, "think")
        assert all(isinstance(d, ReasoningDelta | ContentDelta) for d in deltas)
        out = collect(deltas)
        assert (out.reasoning, out.content) == (reasoning, content), pieces
    plain = parse_output(text, reasoning_parser("none"), None, prompt=prompt)
    assert (plain.reasoning, plain.content) == (None, text)


def test_reasoning_then_tool_calls() -> None:
    text = ("<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call>')  # fmt: skip
    expected = ("\nThe user wants weather.\n", "", [("get_weather", {"city": "Bern"})])
    for pieces in _split_streams(text):
        assert _shape(collect(_stream(pieces, "hermes", "", "think"))) == expected


# --- registry ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("template", "name"), [
    ("{% for tool in tools %}<tools>{{ tool }}</tools>{% endfor %}<tool_call>", "hermes"),
    ("<tool_call>\n<function=example_function_name>\n<parameter=x>", "qwen3_coder"),
    ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral"),
    ('Respond in the format {"name": function name, "parameters": dictionary of argument', 
     "llama3_json"),
    ("[func_name1(params_name1=params_value1, params_name2=params_value2...)]", "pythonic"),
    ("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
    (None, "hermes"),
])  # fmt: skip
def test_auto_picks_the_format_a_template_teaches(template, name):
    assert tool_format_of_template(template) == name
    assert tool_call_parser("auto", template).name == name


def test_unknown_names_say_the_choices() -> None:
    with pytest.raises(KeyError, match="hermes, llama3_json, mistral, qwen3_coder, pythonic"):
        tool_call_parser("nope")
    with pytest.raises(KeyError, match="none, think"):
        reasoning_parser("nope")


# --- grammars ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def matcher_for(tmp_path_factory: pytest.TempPathFactory):
    """A function: grammar spec -> (does it accept `text`)."""
    import tokenizers
    from llguidance import LLMatcher, LLTokenizer

    from tests.helpers.models import write_tokenizer_dir

    path = write_tokenizer_dir(tmp_path_factory.mktemp("tok")) / "tokenizer.json"
    tokenizer = tokenizers.Tokenizer.from_file(str(path))
    ll = LLTokenizer(path.read_text(), n_vocab=tokenizer.get_vocab_size(), eos_token=0)
    build = {"lark": LLMatcher.grammar_from_lark, "regex": LLMatcher.grammar_from_regex,
             "json_schema": LLMatcher.grammar_from_json_schema}  # fmt: skip

    def accepts(spec, text: str) -> bool:
        matcher = LLMatcher(ll, build[spec.kind](spec.source), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    return accepts


GRAMMAR_CASES = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    ),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis <b>\n"
        "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    ),
    ("pythonic", '[get_weather(city="Paris", days=2)]'),
]


@pytest.mark.parametrize(("tool", "call"), GRAMMAR_CASES, ids=[c[0] for c in GRAMMAR_CASES])
def test_each_format_grammar_accepts_its_calls_and_applies_after_reasoning(matcher_for, tool, call):
    parser = tool_call_parser(tool)
    required = parser.grammar(TOOLS, required=True, parallel=True, special_ids={})
    auto = parser.grammar(TOOLS, required=False, parallel=True, special_ids={})
    assert matcher_for(required, call) and matcher_for(auto, call)
    assert not matcher_for(required, call.replace("get_weather", "get_wether"))
    assert not matcher_for(required, "Hello there.") and matcher_for(auto, "Hello there.")
    # The whole output parses back to the call the grammar forced.
    (parsed,) = parse_output(call, reasoning_parser("none"), parser, prompt="",
                             tools=TOOLS).tool_calls  # fmt: skip
    assert parsed.name == "get_weather" and json.loads(parsed.arguments)["city"].startswith("Paris")
    # Under a reasoning parser, the grammar starts after </think>: free text before it.
    think = reasoning_parser("think")
    reasoned = think.constrain(required, "<|im_start|>assistant\n<think>\n")
    assert matcher_for(reasoned, "Any {text} <tool_call> at all.\n</think>\n\n" + call)
    assert not matcher_for(reasoned, "Done.\n</think>\n\nHello there.")


def test_json_schema_applies_after_the_reasoning_ends(matcher_for):
    spec = json_schema_spec({"type": "object", "properties": {"x": {"type": "integer"}},
                             "required": ["x"]})  # fmt: skip
    think = reasoning_parser("think")
    inside = think.constrain(spec, "<think>\n")
    assert matcher_for(inside, 'x is "one" </thin k>\n</think>\n\n{"x": 1}')
    assert not matcher_for(inside, '{"x": 1}')  # the reasoning must end first
    assert not matcher_for(inside, 'a</think> b</think>{"x": 1}')  # ends at the first marker
    outside = think.constrain(spec, "<|im_start|>assistant\n")
    assert matcher_for(outside, '{"x": 1}') and matcher_for(outside, '<think>a</think>{"x": 1}')
    assert reasoning_parser("none").constrain(spec, "<think>") == spec
