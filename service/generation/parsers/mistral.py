"""Mistral tool calls, after the `[TOOL_CALLS]` control token, in both of Mistral's layouts:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (tokenizer < v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                              (v11 and later)

text before the first `[TOOL_CALLS]` is content. Call ids are nine letters and digits (Mistral's
templates refuse others when the calls come back in the conversation)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

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
    calls_json_grammar,
    free_text_rule,
    lark_literal,
    special_or_literal,
)
from service.generation.parsers.json_call import JsonCallReader, is_object
from service.generation.parsers.json_scan import JsonValueScanner
from service.generation.parsers.text import held_suffix, short_call_id

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralParser:
    name = "mistral"
    markers: frozenset[str] = frozenset({TOOL_CALLS, ARGS})

    def start(self, tools: tuple[FunctionTool, ...]) -> MistralStream:
        return MistralStream()

    def grammar(
        self,
        tools: tuple[FunctionTool, ...],
        *,
        required: bool,
        parallel: bool,
        special_ids: Mapping[str, int],
    ) -> GrammarSpec:
        marker = special_or_literal(TOOL_CALLS, special_ids)
        lines = ["start: calls" if required else "start: calls | TEXT"]
        if ARGS in special_ids:  # a v11+ tokenizer: name [ARGS] arguments, per call
            args = special_or_literal(ARGS, special_ids)
            lines += [
                "calls: call+" if parallel else "calls: call",
                "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
            ]
            for i, tool in enumerate(tools):
                schema = {**integral(tool.parameters), "x-guidance": {
                    **JSON_OPTIONS, "lenient": not tool.strict}}  # fmt: skip
                lines.append(
                    f"call_{i}: {marker} {lark_literal(tool.name)} {args} %json {json.dumps(schema)}"
                )
        else:
            lines += [
                f'calls: {marker} "[" call (", " call)* "]"' if parallel
                else f'calls: {marker} "[" call "]"',
                f"call: {calls_json_grammar(tools)}",
            ]  # fmt: skip
        if not required:
            lines.append(free_text_rule((TOOL_CALLS,)))
        return GrammarSpec("lark", "\n".join(lines) + "\n")


class MistralStream:
    """States: text (content), list (a v<11 array of call objects), name (v11: the function's
    name until `[ARGS]`), args (v11: the arguments value)."""

    def __init__(self, new_id: Callable[[], str] = short_call_id) -> None:
        self._new_id = new_id
        self._held = ""
        self._state = "text"
        self._count = 0
        self._source = ""
        self._reader: JsonCallReader | None = None  # list layout
        self._scanner: JsonValueScanner | None = None  # v11 arguments
        self._arguments = ""
        self._name = ""

    def feed(self, text: str) -> list[OutputDelta]:
        self._held += text
        out: list[OutputDelta] = []
        while self._held:
            before = (self._state, len(self._held))
            getattr(self, f"_on_{self._state}")(out)
            if (self._state, len(self._held)) == before:
                break  # waiting for more text
        return [d for d in out if not isinstance(d, ContentDelta) or d.text]

    def _on_text(self, out: list[OutputDelta]) -> None:
        at = self._held.find(TOOL_CALLS)
        if at < 0:
            cut = len(self._held) - held_suffix(self._held, (TOOL_CALLS,))
            if not (self._count and not self._held[:cut].strip()):
                out.append(ContentDelta(self._held[:cut]))
                self._held = self._held[cut:]
            return
        if self._held[:at].strip() or not self._count:
            out.append(ContentDelta(self._held[:at]))
        self._held = self._held[at + len(TOOL_CALLS) :]
        self._source = TOOL_CALLS
        self._state = "opened"

    def _on_opened(self, out: list[OutputDelta]) -> None:
        head = self._held.lstrip()
        if not head:
            return
        if head.startswith("["):
            self._source += self._held[: len(self._held) - len(head) + 1]
            self._held, self._state = head[1:], "list"
        else:
            self._state, self._name = "name", ""

    def _on_list(self, out: list[OutputDelta]) -> None:
        if self._reader is None:
            head = self._held.lstrip().lstrip(",").lstrip()
            if not head:
                self._source += self._held
                self._held = ""
                return
            if head.startswith("]"):
                self._source = ""
                self._held, self._state = head[1:], "text"
                return
            self._source += self._held[: len(self._held) - len(head)]
            self._held = head
            self._reader = JsonCallReader(self._count, self._new_id)
        held, self._held = self._held, ""
        deltas, rest = self._reader.feed(held)
        self._source += held[: len(held) - len(rest)]
        out.extend(deltas)
        if self._reader.done:
            reader, self._reader = self._reader, None
            if reader.started:
                out.append(reader.end(self._source, closed=True))
                self._count += 1
            else:
                out.append(ContentDelta(self._source))
            self._source, self._held = "", rest

    def _on_name(self, out: list[OutputDelta]) -> None:
        at = self._held.find(ARGS)
        if at < 0:
            if "\n" in self._held or "{" in self._held:  # no [ARGS] is coming: not a call
                out.append(ContentDelta(self._source + self._held))
                self._source, self._held, self._state = "", "", "text"
            return
        self._source += self._held[: at + len(ARGS)]
        name = self._held[:at].strip()
        self._held = self._held[at + len(ARGS) :]
        out.append(ToolCallStart(self._count, self._new_id(), name))
        self._scanner, self._arguments, self._state = JsonValueScanner(), "", "args"

    def _on_args(self, out: list[OutputDelta]) -> None:
        assert self._scanner is not None
        k = self._scanner.feed(self._held)
        part = self._held[:k] if self._arguments else self._held[:k].lstrip()
        self._source += self._held[:k]
        self._held = self._held[k:]
        if part:
            self._arguments += part
            out.append(ToolCallArgumentsDelta(self._count, part))
        if self._scanner.done:
            out.append(self._v11_end(closed=True))

    def _v11_end(self, *, closed: bool) -> ToolCallEnd:
        end = ToolCallEnd(self._count, self._arguments,
                          closed and is_object(self._arguments), self._source)  # fmt: skip
        self._count += 1
        self._scanner, self._source, self._state = None, "", "text"
        return end

    def finish(self) -> list[OutputDelta]:
        out: list[OutputDelta] = []
        if self._state == "args":
            assert self._scanner is not None
            self._scanner.end()
            out.append(self._v11_end(closed=self._scanner.done))
        elif self._state == "list" and self._reader is not None:
            self._source += self._held
            if self._reader.started:
                out.append(self._reader.end(self._source, closed=False))
                self._count += 1
            else:
                out.append(ContentDelta(self._source))
            self._reader = None
        elif self._state in ("opened", "name"):
            out.append(ContentDelta(self._source + self._held))
        elif self._state == "text" and (self._held.strip() or not self._count):
            out.append(ContentDelta(self._held))
        self._held = ""
        return [d for d in out if not isinstance(d, ContentDelta) or d.text]
