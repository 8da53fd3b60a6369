"""Qwen3-Coder's XML tool calls:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text, typed by the tool's schema (a string unless the schema says
otherwise). String values stream character by character as JSON string text; other values are
told whole once their `</parameter>` arrives (only then are they a number, a bool, an object)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from service.engine.contracts import GrammarSpec
from service.generation.grammar import JSON_OPTIONS, FunctionTool, integral
from service.generation.parsers.contracts import (
    ContentDelta,
    OutputDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from service.generation.parsers.hermes import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    free_text_rule,
    lark_literal,
)
from service.generation.parsers.pythonic import python_value
from service.generation.parsers.text import call_id, held_suffix

PARAMETER_CLOSE = "</parameter>"
FUNCTION_CLOSE = "</function>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
_STRING_ONLY = frozenset({"type", "description", "title", "enum", "minLength", "maxLength"})


def _is_string(schema: Any) -> bool:
    return not isinstance(schema, dict) or schema.get("type", "string") == "string"


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's raw text as the JSON value its schema asks for (text when unsure)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in (None, "string"):
        return text
    if kind == "integer":
        try:
            return int(text.strip())
        except ValueError:
            return text
    if kind == "number":
        try:
            number = float(text.strip())
        except ValueError:
            return text
        return int(number) if number.is_integer() and "." not in text else number
    if kind == "boolean":
        low = text.strip().lower()
        return low == "true" if low in ("true", "false") else text
    ok, value = python_value(text)
    return value if ok else text


class Qwen3CoderParser:
    name = "qwen3_coder"
    markers: frozenset[str] = frozenset()

    def start(self, tools: tuple[FunctionTool, ...]) -> Qwen3CoderStream:
        return Qwen3CoderStream(tools)

    def grammar(
        self,
        tools: tuple[FunctionTool, ...],
        *,
        required: bool,
        parallel: bool,
        special_ids: Mapping[str, int],
    ) -> GrammarSpec:
        lines = [
            "start: calls" if required else "start: calls | TEXT",
            'calls: call ("\\n" call)*' if parallel else "calls: call",
            (
                f"call: {lark_literal(TOOL_CALL_OPEN + chr(10))} function "
                f"{lark_literal(TOOL_CALL_CLOSE)}"
            ),
            "function: " + " | ".join(f"function_{i}" for i in range(len(tools))),
            # A string value: any text up to the first close marker (one lexeme, so the mask
            # stays open inside it).
            (
                "STR_VALUE: /(?s:.*)\\n<\\/parameter>\\n/"
                " & ~/(?s:.*)<\\/parameter>(?s:.*)<\\/parameter>(?s:.*)/"
            ),
        ]
        for i, tool in enumerate(tools):
            lines += _function_rules(i, tool)
        if not required:
            lines.append(free_text_rule((TOOL_CALL_OPEN,)))
        return GrammarSpec("lark", "\n".join(lines) + "\n")


def _function_rules(i: int, tool: FunctionTool) -> list[str]:
    params = integral(tool.parameters)
    props: dict[str, Any] = params.get("properties", {}) or {}
    required = set(params.get("required", []))
    rules, body = [], []
    for j, (name, schema) in enumerate(props.items()):
        head = lark_literal(f"<parameter={name}>\n")
        if _is_string(schema) and set(schema) <= _STRING_ONLY and "enum" not in schema:
            value = "STR_VALUE"
        else:
            doc = {**schema, "x-guidance": JSON_OPTIONS}
            value = f'%json {json.dumps(doc)} "\\n</parameter>\\n"'
        rules.append(f"param_{i}_{j}: {head} {value}")
        body.append(f"param_{i}_{j}" if name in required else f"param_{i}_{j}?")
    opening = lark_literal(f"<function={tool.name}>\n")
    rules.insert(
        0, f"function_{i}: {opening} {' '.join(body)} {lark_literal(FUNCTION_CLOSE + chr(10))}"
    )
    return rules


class Qwen3CoderStream:
    """States: text, function (after `<tool_call>`), params (between parameters), value (a
    parameter's text), close (after `</function>`, until `</tool_call>`)."""

    def __init__(self, tools: tuple[FunctionTool, ...], new_id: Callable[[], str] = call_id
                 ) -> None:  # fmt: skip
        self._schemas = {t.name: integral(t.parameters).get("properties", {}) or {} for t in tools}
        self._new_id = new_id
        self._held = ""
        self._state = "text"
        self._count = 0
        self._source = ""
        self._props: dict[str, Any] = {}
        self._key = ""
        self._streaming = False  # the current value streams as a JSON string
        self._value_started = False
        self._value = ""
        self._arguments = ""
        self._steps = {
            "text": self._on_text, "function": self._on_function, "params": self._on_params,
            "value": self._on_value, "close": self._on_close,
        }  # fmt: skip

    def feed(self, text: str) -> list[OutputDelta]:
        self._held += text
        out: list[OutputDelta] = []
        while self._held:
            before = (self._state, len(self._held))
            self._steps[self._state](out)
            if (self._state, len(self._held)) == before:
                break
        return [d for d in out if not isinstance(d, ContentDelta) or d.text]

    def _take(self, n: int) -> str:
        taken, self._held = self._held[:n], self._held[n:]
        self._source += taken
        return taken

    def _on_text(self, out: list[OutputDelta]) -> None:
        at = self._held.find(TOOL_CALL_OPEN)
        if at < 0:
            cut = len(self._held) - held_suffix(self._held, (TOOL_CALL_OPEN,))
            if not (self._count and not self._held[:cut].strip()):
                out.append(ContentDelta(self._held[:cut]))
                self._held = self._held[cut:]
            return
        if self._held[:at].strip() or not self._count:
            out.append(ContentDelta(self._held[:at]))
        self._held, self._source = self._held[at:], ""
        self._take(len(TOOL_CALL_OPEN))
        self._state = "function"

    def _on_function(self, out: list[OutputDelta]) -> None:
        head = _FUNCTION.match(self._held)
        if head is None:
            if not re.fullmatch(r"\s*(<(f(u(n(c(t(i(o(n(=[^>\n]*)?)?)?)?)?)?)?)?)?)?", self._held):
                self._abandon(out)  # not a call in this format: its text is content
            return
        name = head.group(1).strip()
        self._take(head.end())
        self._props = self._schemas.get(name, {})
        self._arguments = ""
        out.append(ToolCallStart(self._count, self._new_id(), name))
        self._state = "params"

    def _on_params(self, out: list[OutputDelta]) -> None:
        stripped = self._held.lstrip()
        if stripped.startswith(FUNCTION_CLOSE):
            self._take(len(self._held) - len(stripped) + len(FUNCTION_CLOSE))
            self._emit(out, "}" if self._arguments else "{}")
            self._state = "close"
            return
        head = _PARAMETER.match(self._held)
        if head is None:
            if not (FUNCTION_CLOSE.startswith(stripped) or "<parameter=".startswith(stripped[:11])
                    and "\n" not in stripped and ">" not in stripped):  # fmt: skip
                out.append(self._end(closed=False))  # broken: the call ends incomplete
                self._state = "text"
            return
        self._key = head.group(1).strip()
        self._take(head.end())
        schema = self._props.get(self._key)
        self._streaming = _is_string(schema)
        self._value, self._value_started = "", False
        sep = "{" if not self._arguments else ", "
        if self._streaming:
            self._emit(out, f'{sep}{json.dumps(self._key)}: "')
        self._state = "value"

    def _on_value(self, out: list[OutputDelta]) -> None:
        if not self._value_started:
            if self._held == "":
                return
            if self._held.startswith("\n"):  # the newline after the tag is layout
                self._take(1)
            self._value_started = True
        at = self._held.find(PARAMETER_CLOSE)
        if at < 0:
            keep = held_suffix(self._held, ("\n" + PARAMETER_CLOSE, PARAMETER_CLOSE))
            piece = self._take(len(self._held) - keep)
        else:
            piece = self._take(at)
            piece = piece.removesuffix("\n")  # the newline before the close tag is layout
        if piece:
            self._value += piece
            if self._streaming:
                self._emit(out, json.dumps(piece, ensure_ascii=False)[1:-1])
        if at < 0:
            return
        self._take(len(PARAMETER_CLOSE))
        if self._streaming:
            self._emit(out, '"')
        else:
            value = typed_value(self._value, self._props.get(self._key))
            sep = "{" if not self._arguments else ", "
            self._emit(
                out, f"{sep}{json.dumps(self._key)}: {json.dumps(value, ensure_ascii=False)}"
            )
        self._state = "params"

    def _on_close(self, out: list[OutputDelta]) -> None:
        stripped = self._held.lstrip()
        if stripped.startswith(TOOL_CALL_CLOSE):
            self._take(len(self._held) - len(stripped) + len(TOOL_CALL_CLOSE))
            out.append(self._end(closed=True))
            self._state = "text"
        elif not TOOL_CALL_CLOSE.startswith(stripped):
            out.append(self._end(closed=False))
            self._state = "text"

    def _emit(self, out: list[OutputDelta], text: str) -> None:
        self._arguments += text
        out.append(ToolCallArgumentsDelta(self._count, text))

    def _end(self, *, closed: bool) -> ToolCallEnd:
        try:
            complete = closed and isinstance(json.loads(self._arguments), dict)
        except ValueError:
            complete = False
        end = ToolCallEnd(self._count, self._arguments, complete, self._source)
        self._count += 1
        self._source = ""
        return end

    def _abandon(self, out: list[OutputDelta]) -> None:
        out.append(ContentDelta(self._source))
        self._source, self._state = "", "text"

    def finish(self) -> list[OutputDelta]:
        out: list[OutputDelta] = []
        if self._state == "function":
            out.append(ContentDelta(self._source + self._held))
        elif self._state in ("params", "value", "close"):
            self._source += self._held
            out.append(self._end(closed=False))
        elif self._held.strip() or not self._count:
            out.append(ContentDelta(self._held))
        self._held = ""
        return [d for d in out if not isinstance(d, ContentDelta) or d.text]
