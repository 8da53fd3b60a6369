"""One output through both parsers: the reasoning parser first, then the tool-call parser over
the content it lets through. `parse_output` is the same chain run over a whole output."""

from __future__ import annotations

from collections.abc import Iterable

from service.generation.grammar import FunctionTool
from service.generation.parsers.contracts import (
    ContentDelta,
    DeltaStream,
    OutputDelta,
    ParsedOutput,
    ParsedToolCall,
    ReasoningDelta,
    ReasoningParser,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallParser,
    ToolCallStart,
)


class OutputStream:
    """The deltas of one output. `tool_parser` None: no tools are active, content stays text."""

    def __init__(
        self,
        reasoning: ReasoningParser,
        tool_parser: ToolCallParser | None,
        *,
        prompt: str,
        tools: tuple[FunctionTool, ...] = (),
    ) -> None:
        self._reasoning = reasoning.start(prompt)
        self._tools: DeltaStream | None = tool_parser.start(tools) if tool_parser else None

    def feed(self, text: str) -> list[OutputDelta]:
        return self._route(self._reasoning.feed(text), final=False)

    def finish(self) -> list[OutputDelta]:
        return self._route(self._reasoning.finish(), final=True)

    def _route(self, deltas: list[OutputDelta], *, final: bool) -> list[OutputDelta]:
        out: list[OutputDelta] = []
        for delta in deltas:
            if isinstance(delta, ContentDelta) and self._tools is not None:
                out.extend(self._tools.feed(delta.text))
            else:
                out.append(delta)
        if final and self._tools is not None:
            out.extend(self._tools.finish())
        return _merged(out)


def _merged(deltas: list[OutputDelta]) -> list[OutputDelta]:
    """Adjacent text deltas of one kind joined (fewer, larger chunks; same text)."""
    out: list[OutputDelta] = []
    for d in deltas:
        last = out[-1] if out else None
        if isinstance(d, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + d.text)
        elif isinstance(d, ReasoningDelta) and isinstance(last, ReasoningDelta):
            out[-1] = ReasoningDelta(last.text + d.text)
        elif (
            isinstance(d, ToolCallArgumentsDelta)
            and isinstance(last, ToolCallArgumentsDelta)
            and last.index == d.index
        ):
            out[-1] = ToolCallArgumentsDelta(d.index, last.text + d.text)
        elif not (
            isinstance(d, ContentDelta | ReasoningDelta | ToolCallArgumentsDelta) and not d.text
        ):
            out.append(d)
    return out


def collect(deltas: Iterable[OutputDelta]) -> ParsedOutput:
    """A whole output from its deltas: an incomplete call becomes content (its source text)."""
    reasoning: list[str] | None = None
    content: list[str] = []
    starts: dict[int, ToolCallStart] = {}
    calls: list[ParsedToolCall] = []
    for d in deltas:
        if isinstance(d, ReasoningDelta):
            reasoning = [*(reasoning or []), d.text]
        elif isinstance(d, ContentDelta):
            content.append(d.text)
        elif isinstance(d, ToolCallStart):
            starts[d.index] = d
        elif isinstance(d, ToolCallEnd):
            start = starts.get(d.index)
            if d.complete and start is not None:
                calls.append(ParsedToolCall(start.id, start.name, d.arguments))
            else:
                content.append(d.source)
    return ParsedOutput(
        None if reasoning is None else "".join(reasoning), "".join(content), tuple(calls)
    )


def parse_output(
    text: str,
    reasoning: ReasoningParser,
    tool_parser: ToolCallParser | None,
    *,
    prompt: str,
    tools: tuple[FunctionTool, ...] = (),
) -> ParsedOutput:
    """A whole output split into reasoning, content and complete tool calls."""
    stream = OutputStream(reasoning, tool_parser, prompt=prompt, tools=tools)
    return collect([*stream.feed(text), *stream.finish()])
