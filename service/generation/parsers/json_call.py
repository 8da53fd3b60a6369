"""One JSON tool call object, `{"name": ..., "arguments": {...}}` (or "parameters", Llama's
word), read as it is generated: the call starts once its name is known and its arguments
object is streamed out as written. Shared by the formats that wrap such objects (hermes,
llama3_json, mistral before v11)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from service.generation.parsers.contracts import (
    OutputDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from service.generation.parsers.json_scan import JsonValueScanner

ARGUMENT_KEYS = ("arguments", "parameters")
# The head of a call written name first: then its arguments can stream.
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


def arguments_of(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a whole call object, None when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = next((value[k] for k in ARGUMENT_KEYS if k in value), {})
    if not isinstance(args, dict):
        return None
    return value["name"], json.dumps(args, ensure_ascii=False)


def is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class JsonCallReader:
    """Reads one call object from its first character (blank space may precede it)."""

    def __init__(self, index: int, new_id: Callable[[], str]) -> None:
        self.index = index
        self._new_id = new_id
        self._object = JsonValueScanner()
        self._args: JsonValueScanner | None = None
        self.text = ""  # the object's text so far
        self._arguments: list[str] = []
        self.started = False

    @property
    def done(self) -> bool:
        return self._object.done

    def feed(self, text: str) -> tuple[list[OutputDelta], str]:
        """(deltas, the text after the object once it is over; "" until then)."""
        n = self._object.feed(text)
        piece, rest = text[:n], text[n:]
        before = len(self.text)
        self.text += piece
        out: list[OutputDelta] = []
        if not self.started:
            head = _HEAD.match(self.text)
            if head is not None:
                name = json.loads(f'"{head.group(1)}"')
                self.started = True
                self._args = JsonValueScanner()
                out.append(ToolCallStart(self.index, self._new_id(), name))
                piece = self.text[head.end() :]
            else:
                piece = ""
        elif before == len(self.text):
            piece = ""
        if self._args is not None and piece and not self._args.done:
            k = self._args.feed(piece)
            # Blank space before the arguments' first character is not part of them.
            part = piece[:k] if self._arguments else piece[:k].lstrip()
            if part:
                self._arguments.append(part)
                out.append(ToolCallArgumentsDelta(self.index, part))
        if self._object.done:
            out.extend(self._complete())
        return out, rest

    def _complete(self) -> list[OutputDelta]:
        """At the object's end: a call written arguments first is told whole now."""
        if self.started:
            return []
        parsed = arguments_of(self.text)
        if parsed is None:
            return []
        name, arguments = parsed
        self.started = True
        self._arguments = [arguments]
        return [
            ToolCallStart(self.index, self._new_id(), name),
            ToolCallArgumentsDelta(self.index, arguments),
        ]

    def end(self, source: str, *, closed: bool) -> ToolCallEnd:
        """The call's end; complete when `closed` (its format's end marker came), the object
        ended and its arguments are one JSON object."""
        arguments = "".join(self._arguments)
        complete = (
            closed and self._object.done and arguments_of(self.text) is not None
            and is_object(arguments)
        )  # fmt: skip
        return ToolCallEnd(self.index, arguments, complete, source)
