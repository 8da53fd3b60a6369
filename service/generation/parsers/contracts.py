"""The contracts of output parsers: what a model's raw text becomes once its reasoning and its
tool calls are split out, as typed deltas (streaming) or one `ParsedOutput` (whole output).

The parsers are API-neutral: they know model formats (`<think>`, `<tool_call>`, `[TOOL_CALLS]`,
...) and nothing of OpenAI / Anthropic JSON. Each API turns the deltas into its own events:

    text deltas ─► ReasoningParser stream ─► ReasoningDelta ............................ out
                                         └─► content ─► ToolCallParser stream ─► ContentDelta,
                                                        ToolCallStart, ToolCallArgumentsDelta,
                                                        ToolCallEnd ................... out

`service.generation.parsers.pipeline.OutputStream` chains the two; `parse_output` runs the same
chain over a whole output, so a streamed and a unary answer always agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from service.engine.contracts import GrammarSpec
from service.generation.grammar import FunctionTool


@dataclass(frozen=True)
class ReasoningDelta:
    """Text of the model's reasoning (between `<think>` and `</think>`, markers excluded)."""

    text: str


@dataclass(frozen=True)
class ContentDelta:
    """Text of the answer (what is neither reasoning nor a tool call)."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call begins: its position among the output's calls (0, 1, ...), a fresh id and the
    function's name. Always before the call's argument deltas."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    """The next piece of call `index`'s arguments, as JSON text. The pieces of one call, joined,
    are its arguments object (`ToolCallEnd.arguments` when the call completes)."""

    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    """Call `index` is over. `complete`: it closed and its arguments are one JSON object;
    False when the output ended inside it (cut by max_tokens, or a call that never closes) or
    it does not parse. `source`: the call's text as the model wrote it (a whole-output parse
    returns an incomplete call as this content text instead of a call)."""

    index: int
    arguments: str  # the joined argument deltas
    complete: bool
    source: str


OutputDelta = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd


@dataclass(frozen=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output split: reasoning (None: the output had none), content (text; "" when
    there is only reasoning and calls) and the complete tool calls, in order."""

    reasoning: str | None
    content: str
    tool_calls: tuple[ParsedToolCall, ...] = ()


class DeltaStream(Protocol):
    """The per-request state of one parser over one output."""

    def feed(self, text: str) -> list[OutputDelta]:
        """Takes the next generated text (any split, even inside a marker); returns what can
        be told now. Text that could still be the start of a marker is held back."""
        ...

    def finish(self) -> list[OutputDelta]:
        """The output ended: what was held back (a call still open ends incomplete)."""
        ...


class ReasoningParser(Protocol):
    """A reasoning format (e.g. `<think>…</think>`), registered by name. Stateless: `start`
    makes the state of one output."""

    name: str

    def start(self, prompt: str) -> DeltaStream:
        """A stream over the output of `prompt` (the rendered prompt tells whether the output
        starts inside the reasoning: templates that open `<think>` themselves). Yields
        `ReasoningDelta` and `ContentDelta` only."""
        ...

    def constrain(self, spec: GrammarSpec, prompt: str) -> GrammarSpec:
        """`spec` made to apply only after the reasoning: free text until the end marker, then
        `spec`. "none" returns `spec` unchanged."""
        ...


class ToolCallParser(Protocol):
    """A model family's tool-call format, registered by name. Stateless."""

    name: str
    # Texts of special tokens this format needs to see in the output (e.g. `[TOOL_CALLS]`,
    # `<|python_tag|>`): the caller keeps them in the text it feeds, although it drops other
    # special tokens.
    markers: frozenset[str]

    def start(self, tools: tuple[FunctionTool, ...]) -> DeltaStream:
        """A stream over one output (content text, reasoning already split off). `tools`: the
        declared functions (formats that write arguments as text need their schemas to type
        them). Yields `ContentDelta` and `ToolCall*` deltas only."""
        ...

    def grammar(
        self,
        tools: tuple[FunctionTool, ...],
        *,
        required: bool,
        parallel: bool,
        special_ids: Mapping[str, int],
    ) -> GrammarSpec:
        """A grammar whose outputs are valid calls of `tools` in this format: one call (or
        several with `parallel`); without `required`, free text that does not start a call is
        allowed instead (tool_choice "auto"). `special_ids`: the tokenizer's special tokens
        (text -> id), so that a marker that is a special token is written as that token."""
        ...
