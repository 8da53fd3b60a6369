"""Hermes-style tool calls (NousResearch Hermes 2/3, Qwen2.5, Qwen3 and most ChatML models):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call; text before the first block is content."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from service.engine.contracts import GrammarSpec
from service.generation.grammar import JSON_OPTIONS, FunctionTool, integral
from service.generation.parsers.contracts import ContentDelta, OutputDelta
from service.generation.parsers.json_call import JsonCallReader
from service.generation.parsers.text import call_id, held_suffix

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


def call_schema(tool: FunctionTool, arguments_key: str = "arguments") -> dict[str, Any]:
    """JSON schema of one call object `{"name": ..., "<arguments_key>": {...}}` of `tool`."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.name},
            arguments_key: integral(tool.parameters),
        },
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def calls_json_grammar(tools: tuple[FunctionTool, ...], arguments_key: str = "arguments") -> str:
    """`%json {...}`: a call object of any one of `tools`, as Lark's right-hand side."""
    schemas = [call_schema(t, arguments_key) for t in tools]
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema["x-guidance"] = {**JSON_OPTIONS, "lenient": not all(t.strict for t in tools)}
    return f"%json {json.dumps(schema)}"


def lark_literal(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)


def special_or_literal(marker: str, special_ids: Mapping[str, int]) -> str:
    """A marker in Lark: the special token itself when the tokenizer has one (a model writes
    it as that one token), else its text."""
    token = special_ids.get(marker)
    return f"<[{token}]>" if token is not None else lark_literal(marker)


def free_text_rule(starts: tuple[str, ...]) -> str:
    """`TEXT`: any text that does not start (after blank space) with one of `starts`."""
    banned = " | ".join(f"/[ \\n]*{_regex_literal(s)}(?s:.*)/" for s in starts)
    return f"TEXT: /(?s:.+)/ & ~({banned})" if len(starts) > 1 else (f"TEXT: /(?s:.+)/ & ~{banned}")


def _regex_literal(text: str) -> str:
    out = []
    for ch in text:
        out.append("\\" + ch if ch in "\\^$.|?*+()[]{}/" else ch)
    return "".join(out)


class HermesParser:
    name = "hermes"
    markers: frozenset[str] = frozenset()

    def start(self, tools: tuple[FunctionTool, ...]) -> HermesStream:
        return HermesStream()

    def grammar(
        self,
        tools: tuple[FunctionTool, ...],
        *,
        required: bool,
        parallel: bool,
        special_ids: Mapping[str, int],
    ) -> GrammarSpec:
        open_, close = (
            special_or_literal(m, special_ids) for m in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
        )
        lines = [
            "start: calls" if required else "start: calls | TEXT",
            'calls: call ("\\n" call)*' if parallel else "calls: call",
            f'call: {open_} "\\n" function "\\n" {close}',
            f"function: {calls_json_grammar(tools)}",
        ]
        if not required:
            # Free text, but never the start of a call: once it opens, the call grammar rules.
            lines.append(free_text_rule((TOOL_CALL_OPEN,)))
        return GrammarSpec("lark", "\n".join(lines) + "\n")


class HermesStream:
    """Text outside blocks is content (blank space between and after calls is dropped); inside
    a block, the call object streams through a JsonCallReader until `</tool_call>`."""

    def __init__(self, new_id: Callable[[], str] = call_id) -> None:
        self._new_id = new_id
        self._held = ""
        self._call: JsonCallReader | None = None
        self._source = ""  # the open block's text so far
        self._count = 0

    def feed(self, text: str) -> list[OutputDelta]:
        out: list[OutputDelta] = []
        self._held += text
        while self._held:
            if self._call is None:
                at = self._held.find(TOOL_CALL_OPEN)
                if at < 0:
                    cut = len(self._held) - held_suffix(self._held, (TOOL_CALL_OPEN,))
                    if self._count and not self._held[:cut].strip():
                        break  # blank space after a call: wait for what follows
                    out.append(ContentDelta(self._held[:cut]))
                    self._held = self._held[cut:]
                    break
                before = self._held[:at]
                if before.strip() or not self._count:
                    out.append(ContentDelta(before))
                self._held = self._held[at + len(TOOL_CALL_OPEN) :]
                self._call = JsonCallReader(self._count, self._new_id)
                self._source = TOOL_CALL_OPEN
                continue
            if not self._call.done:
                held, self._held = self._held, ""
                deltas, rest = self._call.feed(held)
                self._source += held[: len(held) - len(rest)]
                out.extend(deltas)
                if not self._call.done:
                    if TOOL_CALL_CLOSE in self._call.text:  # closed inside the object: broken
                        out.extend(self._end_call(closed=False, rest=""))
                    break
                self._held = rest
            # After the object: blank space, then the close marker.
            at = self._held.find(TOOL_CALL_CLOSE)
            if at < 0:
                if self._held.strip() and not TOOL_CALL_CLOSE.startswith(self._held.strip()):
                    out.extend(self._end_call(closed=False, rest=self._held))
                    continue
                break
            if self._held[:at].strip():
                out.extend(self._end_call(closed=False, rest=self._held))
                continue
            self._source += self._held[: at + len(TOOL_CALL_CLOSE)]
            out.extend(self._end_call(closed=True, rest=self._held[at + len(TOOL_CALL_CLOSE) :]))
        return [d for d in out if not isinstance(d, ContentDelta) or d.text]

    def _end_call(self, *, closed: bool, rest: str) -> list[OutputDelta]:
        """Ends the open call; `rest` is read as text again."""
        call, source = self._call, self._source
        assert call is not None
        self._call, self._source, self._held = None, "", rest
        if not call.started:
            return [ContentDelta(source)]  # never became a call: its text is content
        self._count += 1
        return [call.end(source, closed=closed)]

    def finish(self) -> list[OutputDelta]:
        out: list[OutputDelta] = []
        if self._call is not None:
            self._source += self._held
            out.extend(self._end_call(closed=False, rest=""))
        elif not self._count or self._held.strip():
            out.append(ContentDelta(self._held))
        self._held = ""
        return [d for d in out if not isinstance(d, ContentDelta) or d.text]
