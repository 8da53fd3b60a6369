"""Reasoning parsers: "think" splits the `<think>…</think>` reasoning of Qwen3, DeepSeek-R1,
SmolLM3 (and the many models trained on their traces) from the answer; "none" leaves the output
as content.

Whether an output starts inside its reasoning is read from the rendered prompt, not guessed from
the output: DeepSeek-R1's template (and Qwen3's with thinking off, as `<think>\\n\\n</think>`)
writes the markers into the prompt itself, while Qwen3's and SmolLM3's thinking mode leave the
opening `<think>` to the model.
"""

from __future__ import annotations

import re

from service.engine.contracts import GrammarSpec
from service.generation.parsers.contracts import (
    ContentDelta,
    OutputDelta,
    ReasoningDelta,
)
from service.generation.parsers.text import held_suffix

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class NoReasoning:
    """The "none" parser: everything is content, grammars apply from the first token."""

    name = "none"

    def start(self, prompt: str) -> _Passthrough:
        return _Passthrough()

    def constrain(self, spec: GrammarSpec, prompt: str) -> GrammarSpec:
        return spec


class _Passthrough:
    def feed(self, text: str) -> list[OutputDelta]:
        return [ContentDelta(text)] if text else []

    def finish(self) -> list[OutputDelta]:
        return []


class ThinkReasoning:
    """The `<think>…</think>` family."""

    name = "think"

    def __init__(self, open_marker: str = THINK_OPEN, close_marker: str = THINK_CLOSE) -> None:
        self.open_marker = open_marker
        self.close_marker = close_marker

    def starts_inside(self, prompt: str) -> bool:
        """The prompt ends inside a reasoning block (its last open marker is not closed)."""
        return prompt.rfind(self.open_marker) > prompt.rfind(self.close_marker)

    def start(self, prompt: str) -> _ThinkStream:
        return _ThinkStream(self.open_marker, self.close_marker, self.starts_inside(prompt))

    def constrain(self, spec: GrammarSpec, prompt: str) -> GrammarSpec:
        """Lark: one free-text lexeme that ends at the first close marker (the mask is all-open
        while the model reasons), then `spec`. An output that does not start inside its
        reasoning may open one (after blank space) or answer at once."""
        close, opener = _lark_escape(self.close_marker), _lark_escape(self.open_marker)
        # Any text whose only close marker is its end, then blank lines before the answer.
        body = f"(?s:.*){close}[ \\n]*"
        once = f"~/(?s:.*){close}(?s:.*){close}(?s:.*)/"
        if self.starts_inside(prompt):
            head = ["start: THOUGHT answer", f"THOUGHT: /{body}/ & {once}"]
        else:
            head = [
                "start: THOUGHT answer | answer",
                f"THOUGHT: /[ \\n]*{opener}{body}/ & {once}",
            ]
        return GrammarSpec("lark", "\n".join([*head, *_answer_rules(spec)]) + "\n")


def _lark_escape(text: str) -> str:
    """`text` as a literal inside a Lark `/regex/`."""
    return re.escape(text).replace("/", "\\/")


_START_RULE = re.compile(r"^start(\s*:)", re.MULTILINE)


def _answer_rules(spec: GrammarSpec) -> list[str]:
    """Lark rules whose `answer` rule is `spec`'s language."""
    if spec.kind == "json_schema":
        return [f"answer: %json {spec.source}"]
    if spec.kind == "regex":
        return [f"answer: /{spec.source.replace('/', chr(92) + '/')}/"]
    # A Lark grammar: its start rule becomes `answer` (our grammars never refer to `start`).
    return [_START_RULE.sub(r"answer\1", spec.source, count=1).rstrip("\n")]


class _ThinkStream:
    """States: undecided (the output may still open a reasoning block), reasoning, content."""

    def __init__(self, open_marker: str, close_marker: str, inside: bool) -> None:
        self._open, self._close = open_marker, close_marker
        self._state = "reasoning" if inside else "undecided"
        self._held = ""
        self._trim = False  # the blank lines right after the close marker are not content

    def feed(self, text: str) -> list[OutputDelta]:
        self._held += text
        out: list[OutputDelta] = []
        if self._state == "undecided":
            head = self._held.lstrip()
            if head.startswith(self._open):
                self._state, self._held = "reasoning", head[len(self._open) :]
            elif self._open.startswith(head):
                return out  # blank, or a prefix of the open marker: wait
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._held.find(self._close)
            if end < 0:
                keep = held_suffix(self._held, (self._close,))
                cut = len(self._held) - keep
                out.append(ReasoningDelta(self._held[:cut]))
                self._held = self._held[cut:]
                return [d for d in out if d.text]
            out.append(ReasoningDelta(self._held[:end]))
            self._held = self._held[end + len(self._close) :]
            self._state, self._trim = "content", True
        if self._trim:
            self._held = self._held.lstrip("\n")
            if not self._held:
                return [d for d in out if d.text]
            self._trim = False
        out.append(ContentDelta(self._held))
        self._held = ""
        return [d for d in out if d.text]

    def finish(self) -> list[OutputDelta]:
        held, self._held = self._held, ""
        if not held:
            return []
        # Ended inside the reasoning (max_tokens): it stays reasoning, there is no answer.
        if self._state == "reasoning":
            return [ReasoningDelta(held)]
        return [] if self._trim else [ContentDelta(held)]
