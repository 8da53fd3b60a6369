"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (the format their chat templates teach):

    {"name": "get_weather", "parameters": {"city": "Paris"}}

an output that starts with a call object (optionally after `<|python_tag|>`) is calls,
several separated by `;`; any other output is content. A call closes with its object (the
model then ends its turn with `<|eom_id|>` / `<|eot_id|>`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from service.engine.contracts import GrammarSpec
from service.generation.grammar import FunctionTool
from service.generation.parsers.contracts import ContentDelta, OutputDelta
from service.generation.parsers.hermes import calls_json_grammar, free_text_rule
from service.generation.parsers.json_call import JsonCallReader
from service.generation.parsers.text import call_id

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser:
    name = "llama3_json"
    markers: frozenset[str] = frozenset({PYTHON_TAG})

    def start(self, tools: tuple[FunctionTool, ...]) -> Llama3JsonStream:
        return Llama3JsonStream()

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
            'calls: call ("; " call)*' if parallel else "calls: call",
            f"call: {calls_json_grammar(tools, 'parameters')}",
        ]
        if not required:
            lines.append(free_text_rule(("{", PYTHON_TAG)))
        return GrammarSpec("lark", "\n".join(lines) + "\n")


class Llama3JsonStream:
    def __init__(self, new_id: Callable[[], str] = call_id) -> None:
        self._new_id = new_id
        self._held = ""
        self._mode = "undecided"  # | "content" | "calls"
        self._call: JsonCallReader | None = None
        self._source = ""
        self._count = 0

    def feed(self, text: str) -> list[OutputDelta]:
        self._held += text
        out: list[OutputDelta] = []
        if self._mode == "undecided":
            head = self._held.lstrip()
            if head.startswith(PYTHON_TAG):
                self._mode, self._held = "calls", head[len(PYTHON_TAG) :]
            elif head.startswith("{"):
                self._mode, self._held = "calls", head
            elif not head or PYTHON_TAG.startswith(head):
                return out
            else:
                self._mode = "content"
        if self._mode == "content":
            held, self._held = self._held, ""
            return [ContentDelta(held)] if held else []
        while self._held:
            if self._call is None:
                head = self._held.lstrip().lstrip(";").lstrip()
                if not head or self._held.strip() == ";":
                    break  # a separator so far: wait for the next call
                if not head.startswith("{"):
                    # Not another call: the rest of the output is content.
                    self._mode = "content"
                    out.append(ContentDelta(self._held))
                    self._held = ""
                    break
                self._call, self._source = JsonCallReader(self._count, self._new_id), ""
                self._held = head
            held, self._held = self._held, ""
            deltas, rest = self._call.feed(held)
            self._source += held[: len(held) - len(rest)]
            out.extend(deltas)
            if not self._call.done:
                break
            out.extend(self._end(closed=True))
            self._held = rest
        return out

    def _end(self, *, closed: bool) -> list[OutputDelta]:
        call, source = self._call, self._source
        assert call is not None
        self._call, self._source = None, ""
        if not call.started:
            return [ContentDelta(source)] if source else []
        self._count += 1
        return [call.end(source, closed=closed)]

    def finish(self) -> list[OutputDelta]:
        out: list[OutputDelta] = []
        if self._call is not None:
            out.extend(self._end(closed=False))
        if self._held.strip(" \n;") or (self._mode == "undecided" and self._held):
            out.append(ContentDelta(self._held))
        self._held = ""
        return out
