"""Where a JSON value ends, found incrementally: tool-call formats that embed an arguments
object in generated text stream it out character by character and must know, without waiting
for the rest of the output, when the object is over."""

from __future__ import annotations

_SCALAR = frozenset("0123456789+-.eEtruefalsn")


class JsonValueScanner:
    """Tracks one JSON value (object, array, string or scalar) as its text arrives. Does not
    validate: a JSON parse of the finished text does."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._started = False
        self._scalar = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value (all of them while it goes on;
        fewer once it ends, then `done`). Leading blank space belongs to it."""
        for i, ch in enumerate(text):
            if self.done:
                return i
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 0:
                        self.done = True
                continue
            if not self._started:
                if ch.isspace():
                    continue
                self._started = True
                if ch in "{[":
                    self._depth = 1
                elif ch == '"':
                    self._in_string = True
                else:
                    self._scalar = True
                continue
            if self._scalar:
                if ch not in _SCALAR:
                    self.done = True
                    return i
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.done = True
        return len(text)

    def end(self) -> None:
        """The text ended: a scalar ends with it."""
        if self._scalar:
            self.done = True
