"""Pythonic tool calls (Llama 3.2 / Llama 4 / ToolACE style): a Python list of calls with
keyword arguments whose values are Python literals,

    [get_weather(city="Paris", unit="celsius"), get_time()]

optionally inside Llama 4's `<|python_start|>` … `<|python_end|>`. An output that starts with
such a list is calls; any other output is content. Arguments stream one keyword at a time, each
as soon as its value is complete (a value is only JSON once it is whole: `True` -> `true`)."""

from __future__ import annotations

import ast
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
from service.generation.parsers.hermes import free_text_rule, lark_literal
from service.generation.parsers.text import call_id

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_CALL_HEAD = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_KWARG_HEAD = re.compile(r"\s*([A-Za-z_]\w*)\s*=")
# A prefix of "[name(" (so the output may still turn out to be calls).
_MAYBE_CALLS = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?$")
_IS_CALLS = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")


def python_value(text: str) -> tuple[bool, Any]:
    """(ok, value) of a Python literal (JSON's true/false/null also read)."""
    try:
        return True, ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        pass
    try:
        return True, json.loads(text)
    except ValueError:
        return False, None


class _LiteralEnd:
    """Finds where a Python literal ends: at a `,` or `)` outside strings and brackets."""

    def __init__(self) -> None:
        self._depth = 0
        self._quote = ""
        self._escape = False

    def feed(self, text: str) -> int | None:
        """Index in `text` of the delimiter that ends the value, None while it goes on."""
        for i, ch in enumerate(text):
            if self._quote:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == self._quote:
                    self._quote = ""
            elif ch in "\"'":
                self._quote = ch
            elif ch in "([{":
                self._depth += 1
            elif ch in ")]}":
                if self._depth == 0:
                    return i
                self._depth -= 1
            elif ch == "," and self._depth == 0:
                return i
        return None


class PythonicParser:
    name = "pythonic"
    markers: frozenset[str] = frozenset({PYTHON_START, PYTHON_END})

    def start(self, tools: tuple[FunctionTool, ...]) -> PythonicStream:
        return PythonicStream()

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
            'calls: "[" call (", " call)* "]"' if parallel else 'calls: "[" call "]"',
            "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
        ]
        for i, tool in enumerate(tools):
            lines += _call_rules(i, tool)
        lines += [
            r'PY_STR: /"([^"\\\n]|\\.)*"/',
            r"PY_INT: /-?(0|[1-9][0-9]*)/",
            r"PY_NUM: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/",
            'PY_BOOL: "True" | "False"',
        ]
        if not required:
            lines.append(free_text_rule(("[",)))
        return GrammarSpec("lark", "\n".join(lines) + "\n")


def _value_rule(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if kind == "string" and set(schema) <= {"type", "description", "title"}:
        return "PY_STR"
    if kind == "integer" and set(schema) <= {"type", "description", "title"}:
        return "PY_INT"
    if kind == "number" and set(schema) <= {"type", "description", "title"}:
        return "PY_NUM"
    if kind == "boolean":
        return "PY_BOOL"
    # Anything else: JSON (a Python literal too, but for true/false/null, which are read back).
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def _call_rules(i: int, tool: FunctionTool) -> list[str]:
    params = integral(tool.parameters)
    props: dict[str, Any] = params.get("properties", {}) or {}
    required = [p for p in props if p in set(params.get("required", []))]
    optional = [p for p in props if p not in required]
    rules = []
    for j, name in enumerate(props):
        rules.append(f"kw_{i}_{j}: {lark_literal(name + '=')} {_value_rule(props[name])}")
    index = {name: j for j, name in enumerate(props)}
    if required:
        body = ' ", " '.join(f"kw_{i}_{index[p]}" for p in required)
        body += "".join(f' (", " kw_{i}_{index[p]})?' for p in optional)
    elif optional:
        any_kw = " | ".join(f"kw_{i}_{index[p]}" for p in optional)
        rules.append(f"opt_{i}: {any_kw}")
        body = f'(opt_{i} (", " opt_{i})*)?'
    else:
        body = ""
    rules.insert(0, f'call_{i}: {lark_literal(tool.name + "(")} {body} ")"'.replace("  ", " "))
    return rules


class PythonicStream:
    """States: undecided, content, call (waiting for `name(`), kwarg (waiting for `key=` or
    `)`), value (inside a keyword's value), between (after `)`: `,` or `]`), done."""

    def __init__(self, new_id: Callable[[], str] = call_id) -> None:
        self._new_id = new_id
        self._held = ""
        self._state = "undecided"
        self._count = 0
        self._source = ""
        self._key = ""
        self._value: _LiteralEnd | None = None
        self._value_text = ""  # the keyword value read so far
        self._arguments = ""
        self._valid = True
        self._opened = ""  # what opened the list ("[" or the python_start marker and "[")

    def feed(self, text: str) -> list[OutputDelta]:
        self._held += text
        out: list[OutputDelta] = []
        steps = {
            "undecided": self._on_undecided, "content": self._on_content,
            "call": self._on_call, "kwarg": self._on_kwarg, "value": self._on_value,
            "between": self._on_between, "done": self._on_done,
        }  # fmt: skip
        while self._held:
            before = (self._state, len(self._held))
            steps[self._state](out)
            if (self._state, len(self._held)) == before:
                break
        return [d for d in out if not isinstance(d, ContentDelta) or d.text]

    def _on_undecided(self, out: list[OutputDelta]) -> None:
        head = self._held.lstrip()
        marker = ""
        if head.startswith(PYTHON_START):
            marker, head = PYTHON_START, head[len(PYTHON_START) :].lstrip()
        elif PYTHON_START.startswith(head):
            return
        if _IS_CALLS.match(head):
            self._opened = self._held[: len(self._held) - len(head)] + "["
            self._held, self._state = head[1:], "call"
        elif _MAYBE_CALLS.match(head) or (marker and not head):
            return
        else:
            self._state = "content"

    def _on_content(self, out: list[OutputDelta]) -> None:
        out.append(ContentDelta(self._held))
        self._held = ""

    def _on_call(self, out: list[OutputDelta]) -> None:
        head = _CALL_HEAD.match(self._held)
        if head is None:
            if re.fullmatch(r"\s*[A-Za-z_][\w.]*\s*|\s*", self._held):
                return  # the name is still coming
            self._state = "content"  # not a call after all: the rest is text
            self._held = self._opened + self._source + self._held
            self._opened = self._source = ""
            return
        # The first call's text carries the list's opening (an unfinished list is content).
        self._source = (self._opened if not self._count else "") + self._held[: head.end()]
        self._held = self._held[head.end() :]
        out.append(ToolCallStart(self._count, self._new_id(), head.group(1)))
        self._arguments, self._valid, self._state = "", True, "kwarg"

    def _on_kwarg(self, out: list[OutputDelta]) -> None:
        stripped = self._held.lstrip().lstrip(",").lstrip()
        if stripped.startswith(")"):
            self._source += self._held[: len(self._held) - len(stripped) + 1]
            self._held = stripped[1:]
            self._emit(out, "}" if self._arguments else "{}")
            out.append(self._end(closed=True))
            self._state = "between"
            return
        head = _KWARG_HEAD.match(stripped)
        if head is None:
            if not re.fullmatch(r"\s*[A-Za-z_]*\w*\s*", stripped):
                self._valid = False  # neither `key=` nor `)`: a malformed call
                self._state = "value"
                self._key, self._value = "", _LiteralEnd()
            return
        self._source += self._held[: len(self._held) - len(stripped) + head.end()]
        self._key, self._value = head.group(1), _LiteralEnd()
        self._held, self._state = stripped[head.end() :], "value"

    def _on_value(self, out: list[OutputDelta]) -> None:
        assert self._value is not None
        end = self._value.feed(self._held)
        if end is None:
            self._value_text = self._value_text + self._held
            self._source += self._held
            self._held = ""
            return
        text = self._value_text + self._held[:end]
        self._source += self._held[:end]
        self._held = self._held[end:]
        self._value_text = ""
        ok, value = python_value(text)
        if not ok or not self._key:
            self._valid = False
        else:
            sep = "{" if not self._arguments else ", "
            self._emit(
                out, f"{sep}{json.dumps(self._key)}: {json.dumps(value, ensure_ascii=False)}"
            )
        self._state = "kwarg"

    def _on_between(self, out: list[OutputDelta]) -> None:
        head = self._held.lstrip()
        if not head:
            return
        if head.startswith(","):
            self._held, self._state = head[1:], "call"
        elif head.startswith("]"):
            self._held, self._state = head[1:], "done"
        else:
            self._held, self._state = head, "done"

    def _on_done(self, out: list[OutputDelta]) -> None:
        head = self._held.lstrip()
        if head.startswith(PYTHON_END):
            self._held = head[len(PYTHON_END) :]
        elif PYTHON_END.startswith(head):
            return
        if self._held.strip():  # text after the list is content; blank space is not
            out.append(ContentDelta(self._held))
        self._held = ""

    def _emit(self, out: list[OutputDelta], text: str) -> None:
        self._arguments += text
        out.append(ToolCallArgumentsDelta(self._count, text))

    def _end(self, *, closed: bool) -> ToolCallEnd:
        end = ToolCallEnd(self._count, self._arguments, closed and self._valid,
                          self._source)  # fmt: skip
        self._count += 1
        self._source = ""
        return end

    def finish(self) -> list[OutputDelta]:
        out: list[OutputDelta] = []
        if self._state in ("kwarg", "value"):
            self._source += self._held
            out.append(self._end(closed=False))
        elif self._state == "undecided" or self._state == "content":
            out.append(ContentDelta(self._held))
        elif self._state == "call" and not self._count:
            out.append(ContentDelta(self._opened + self._held))
        self._held = ""
        return [d for d in out if not isinstance(d, ContentDelta) or d.text]
