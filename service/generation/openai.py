"""OpenAI's chat completions and completions as the router runs them: requests decoded from
either face (the HttpBody REST routes or the typed gRPC RPCs) become `GenerateInput`s for the
`GenerationService`, and its sequences and stream items become OpenAI's choices and chunks.

Where OpenAI and TGI differ, OpenAI wins here: sampling is on unless temperature is 0; stop
strings are not part of the output; finish reasons are "stop" / "length". No protobuf and no JSON
here: `service.api.openai_json` and `service.api.openai_convert` encode what this module returns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from service.engine.contracts import FinishReason, TokenInfo
from service.generation.chat_template import ChatTemplate
from service.generation.errors import ModelNotFoundError, ValidationError
from service.generation.grammar import FunctionTool, json_schema_spec
from service.generation.images.refs import ImageRef
from service.generation.parsers.contracts import (
    ContentDelta,
    OutputDelta,
    ReasoningDelta,
    ReasoningParser,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallParser,
    ToolCallStart,
)
from service.generation.parsers.hermes import HermesParser
from service.generation.parsers.pipeline import OutputStream, parse_output
from service.generation.parsers.reasoning import NoReasoning
from service.generation.service import (
    CHAT_COMPLETIONS,
    CHAT_COMPLETIONS_STREAM,
    COMPLETIONS,
    COMPLETIONS_STREAM,
    GeneratedSequence,
    GenerationService,
)
from service.generation.validation import GenerateInput, GrammarInput

# The model name TGI accepts besides the served id, so that its documented example runs as is.
TGI_MODEL_ALIAS = "tgi"
_T = TypeVar("_T")
TEMPERATURE_RANGE = (0.0, 2.0)
FINISH_REASONS: dict[FinishReason, str] = {
    FinishReason.EOS_TOKEN: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.LENGTH: "length",
}
# Field names of the TGI validator -> the OpenAI parameter a client sent.
_PARAMS: dict[str, str] = {
    "parameters.max_new_tokens": "max_tokens",
    "parameters.temperature": "temperature",
    "parameters.top_p": "top_p",
    "parameters.frequency_penalty": "frequency_penalty",
    "parameters.stop": "stop",
    "parameters.seed": "seed",
    "parameters.best_of": "n",
    "parameters.top_n_tokens": "top_logprobs",
    "parameters.grammar": "response_format",
    "parameters.grammar.value": "response_format",
    "parameters.grammar.type": "response_format",
}
TOOL_CALLS = "tool_calls"  # finish_reason of a choice that ends in tool calls


@dataclass(frozen=True)
class ToolCall:
    """One function call of an assistant message (OpenAI's tool_calls[i])."""

    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ResponseFormat:
    """OpenAI's response_format: "text", "json_object" or "json_schema" (with its schema)."""

    type: str
    schema: dict[str, Any] | None = None
    strict: bool = False


@dataclass(frozen=True)
class ToolChoice:
    """OpenAI's tool_choice: mode "auto" | "none" | "required" | "function" (then `function`
    names the one to call)."""

    mode: str = "auto"
    function: str | None = None


@dataclass(frozen=True)
class ChatMessage:
    """One message of a conversation; content is text (text parts already joined)."""

    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant message that called tools
    # Image parts (user messages): (offset in content where the image sits, the image).
    images: tuple[tuple[int, ImageRef], ...] = ()


def image_url_ref(url: object, field: str) -> ImageRef:
    """The image of an image_url part (REST's `image_url.url`, gRPC's `ChatImageUrl.url`);
    ValidationError naming `field` when the URL is missing. The URL itself is checked when the
    image is read (service.generation.images)."""
    if not isinstance(url, str) or not url:
        raise ValidationError(field, f"{field}: an image_url part needs image_url: "
                              '{url: "data:image/...;base64,..." or "https://..."}')
    return ImageRef(field, url=url)


def message_content(
    role: str, parts: Sequence[str | ImageRef], field: str
) -> tuple[str, tuple[tuple[int, ImageRef], ...]]:
    """A message's content parts (text, and images already named by their field) as the message
    text and its images, each at the text offset it sits at. Both the REST and the gRPC chat
    paths build their messages here. ValidationError naming `field` (the content field,
    `messages[i].content`) for an image outside a user message."""
    texts: list[str] = []
    images: list[tuple[int, ImageRef]] = []
    at = 0
    for part in parts:
        if isinstance(part, ImageRef):
            images.append((at, part))
        else:
            texts.append(part)
            at += len(part)
    if images and role != "user":
        raise ValidationError(field, f"{field}: image parts are accepted in user messages only")
    return "".join(texts), tuple(images)


@dataclass(frozen=True)
class SamplingRequest:
    """The request fields chat completions and completions share (None: not sent)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_calls: bool = False  # the output is parsed for tool calls (set by chat, not clients)


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    params: SamplingRequest
    response_format: ResponseFormat | None = None
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice | None = None  # None: "auto" when tools are given
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str
    params: SamplingRequest
    echo: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and its most likely alternatives."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Choice:
    """One finished choice (chat: the assistant message's content; completion: its text)."""

    index: int
    text: str
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...] | None  # None: not asked for
    tool_calls: tuple[ToolCall, ...] = ()  # with no text, the message's content is null
    reasoning: str | None = None  # the reasoning split off the answer (--reasoning-parser)
    stop_sequence: str | None = None  # the stop string that ended it (Anthropic reports it)


@dataclass(frozen=True)
class ResponseHeader:
    """What every object of one response repeats: id, created, model, system_fingerprint."""

    id: str
    created: int
    model: str
    system_fingerprint: str
    # Tokens of the rendered prompt, known before the first chunk (chat streams only).
    prompt_tokens: int | None = None


@dataclass(frozen=True)
class Completed:
    """A finished (unary) response."""

    header: ResponseHeader
    choices: tuple[Choice, ...]
    usage: Usage


@dataclass(frozen=True)
class ChoiceDelta:
    """One chunk's update of choice `index`. `first`: the choice's first chunk (chat sends the
    role there); `finish_reason` is set on its last."""

    index: int
    text: str
    first: bool = False
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    tool_calls: tuple[ToolCallChunk, ...] = ()  # tool-call pieces generated since the last chunk
    reasoning: str = ""  # reasoning text generated since the last chunk
    stop_sequence: str | None = None  # on the finish chunk: the stop string that ended it


@dataclass(frozen=True)
class ToolCallChunk:
    """A piece of call `index` in a stream: its first piece carries the id and the function's
    name, the next ones only more of the arguments' JSON text (joined, they are the arguments)."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class OutputParsers:
    """How chat outputs are split: the reasoning format, the tool-call format, and the
    tokenizer's special tokens (text -> id; a format's markers that are special tokens are
    written as those tokens by its grammar and kept in the text its parser reads)."""

    reasoning: ReasoningParser = field(default_factory=NoReasoning)
    tools: ToolCallParser = field(default_factory=HermesParser)
    special_ids: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Parsing:
    """One chat request's output parsing: the parsers, its prompt, its active tools (none:
    tool calls are not parsed)."""

    parsers: OutputParsers
    prompt: str
    tools: tuple[FunctionTool, ...]

    @property
    def tool_parser(self) -> ToolCallParser | None:
        return self.parsers.tools if self.tools else None

    @property
    def markers(self) -> frozenset[str]:
        """Texts of the special tokens the parsers read (other special tokens are dropped)."""
        parser = self.tool_parser
        tools = parser.markers if parser is not None else frozenset()
        return self.parsers.reasoning.markers | tools

    def keeps(self, token: TokenInfo) -> bool:
        """Whether a special token's text is part of what the parsers read."""
        return token.text in self.markers

    def stream(self) -> OutputStream:
        return OutputStream(self.parsers.reasoning, self.tool_parser, prompt=self.prompt,
                            tools=self.tools)  # fmt: skip


@dataclass(frozen=True)
class UsageChunk:
    """The last chunk of a stream with include_usage."""

    usage: Usage


StreamEvent = ChoiceDelta | UsageChunk


class StopTrimmer:
    """Removes stop strings from streamed text, as OpenAI does (the engine keeps them, as TGI
    does): text that could still become a stop string is held back until it cannot, and the
    text from a stop string on is dropped."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string found

    def push(self, text: str) -> str:
        """Appends generated text; returns what can be sent now."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        pending = self._pending + text
        cut = cut_at_stop(pending, self._stops)
        if cut is not None:
            self.stopped, self._pending = True, ""
            self.matched = stop_at(pending, self._stops)
            return pending[:cut]
        keep = max(
            (k for s in self._stops for k in range(min(len(s) - 1, len(pending)), 0, -1)
             if pending.endswith(s[:k])),
            default=0,
        )  # fmt: skip
        self._pending = pending[len(pending) - keep :]
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        """At the end: what was held back (it never became a stop string)."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out


def cut_at_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index of the earliest stop string in `text`, None when there is none."""
    found = [i for s in stops if (i := text.find(s)) >= 0]
    return min(found) if found else None


def stop_at(text: str, stops: tuple[str, ...]) -> str | None:
    """The stop string found earliest in `text` (None when there is none)."""
    found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(found)[1] if found else None


def _logprob(token: TokenInfo, top: tuple[TokenInfo, ...]) -> TokenLogprob:
    return TokenLogprob(token.text, token.logprob, tuple((t.text, t.logprob) for t in top))


class OpenAIEndpoints:
    """Chat completions and completions on a GenerationService."""

    def __init__(
        self,
        service: GenerationService,
        *,
        model_id: str,
        system_fingerprint: str,
        chat_template: ChatTemplate | None,
        parsers: OutputParsers | None = None,
    ) -> None:
        self.service = service
        self.parsers = parsers or OutputParsers()
        self.model_id = model_id
        self.system_fingerprint = system_fingerprint
        self.created = int(time.time())
        self._template = chat_template

    # --- requests -> GenerateInput ---------------------------------------------------------

    def _check(self, params: SamplingRequest) -> None:
        adapters = [a.name for a in self.service.adapters()]
        if params.model not in (self.model_id, TGI_MODEL_ALIAS, *adapters):
            listed = f"; LoRA adapters: {', '.join(adapters)}" if adapters else ""
            raise ModelNotFoundError(
                f"The model '{params.model}' does not exist: this server serves "
                f"'{self.model_id}' (also reachable as '{TGI_MODEL_ALIAS}'){listed}",
            )
        if params.temperature is not None:
            low, high = TEMPERATURE_RANGE
            if not low <= params.temperature <= high:
                raise ValidationError(
                    "temperature", f"temperature must be in [{low}, {high}]; got "
                    f"{params.temperature}"
                )  # fmt: skip
        if params.presence_penalty:
            raise ValidationError(
                "presence_penalty",
                "presence_penalty is not supported by this server (only 0); use "
                f"frequency_penalty; got {params.presence_penalty}",
            )
        max_n = self.service.validator.limits.max_best_of
        if not 1 <= params.n <= max_n:
            raise ValidationError("n", f"n must be in [1, {max_n}] (--max-best-of); got {params.n}")
        if params.top_logprobs is not None and not params.logprobs:
            raise ValidationError("top_logprobs", "top_logprobs needs logprobs: true")

    def _input(
        self, params: SamplingRequest, prompt: str, prompt_ids: tuple[int, ...] | None
    ) -> GenerateInput:
        # OpenAI samples at temperature 1 by default; 0 means greedy (the validator's rule).
        temperature = 1.0 if params.temperature is None else params.temperature
        return GenerateInput(
            inputs=prompt,
            prompt_ids=prompt_ids,
            temperature=temperature,
            do_sample=temperature != 0.0,
            top_p=params.top_p,
            frequency_penalty=params.frequency_penalty,
            max_new_tokens=params.max_tokens,
            stop=params.stop,
            details=True,
            seed=params.seed,
            top_n_tokens=params.top_logprobs if params.logprobs else None,
            # A model name other than the served id (or "tgi") is a LoRA adapter's.
            adapter_id=None if params.model in (self.model_id, TGI_MODEL_ALIAS) else params.model,
        )

    async def _chat_input(self, request: ChatRequest) -> GenerateInput:
        self._check(request.params)
        if not request.messages:
            raise ValidationError("messages", "messages must not be empty")
        if self._template is None:
            raise ValidationError(
                "messages",
                "this server has no chat template: the model's tokenizer_config.json has none "
                "and the router was started without --chat-template FILE",
            )
        tools = _active_tools(request)
        images = self._images(request.messages)
        declared = request.tools if tools else ()
        prompt, ids = await (
            self._template.render(request.messages, declared, self._image_token()) if images
            else self._template.render(request.messages, declared)
        )
        generate = replace(self._input(request.params, prompt, ids), images=images)
        reasoning = self.parsers.reasoning
        if tools:
            choice = request.tool_choice or ToolChoice()
            spec = self.parsers.tools.grammar(
                tools,
                required=choice.mode in ("required", "function"),
                parallel=request.parallel_tool_calls,
                special_ids=self.parsers.special_ids,
            )
            # The calls' grammar starts where the reasoning ends (the mask is off inside it).
            spec = reasoning.constrain(spec, prompt)
            return replace(generate, grammar_spec=spec, grammar_field="tools")
        rf = request.response_format
        if rf is not None and rf.type != "text":
            if not isinstance(reasoning, NoReasoning):
                schema = rf.schema if rf.type == "json_schema" and rf.schema else {}
                spec = json_schema_spec({**schema, "type": "object"} if rf.type != "json_schema"
                                        else schema, strict=rf.strict)  # fmt: skip
                return replace(generate, grammar_spec=reasoning.constrain(spec, prompt),
                               grammar_field="response_format")  # fmt: skip
            kind = "json" if rf.type == "json_schema" else "json_object"
            grammar = GrammarInput(kind, rf.schema, strict=rf.strict)
            return replace(generate, grammar=grammar, grammar_field="response_format")
        return generate

    def _images(self, messages: tuple[ChatMessage, ...]) -> tuple[ImageRef, ...]:
        """The conversation's images in prompt order; ValidationError for a text model."""
        refs = tuple(ref for m in messages for _, ref in m.images)
        if refs and self.service.validator.images is None:
            raise ValidationError(refs[0].field, f"{refs[0].field}: this model takes no images "
                                  "(its snapshot has no image processor)")
        return refs

    def _image_token(self) -> str:
        pipeline = self.service.validator.images
        return pipeline.image_text if pipeline is not None else ""

    async def chat_prompt(self, request: ChatRequest) -> str:
        """The prompt a chat request renders to (TGI's POST /chat_tokenize), checked as
        generation checks it."""
        return (await self._chat_input(request)).inputs

    def _parsing(self, request: ChatRequest, generate: GenerateInput) -> _Parsing:
        return _Parsing(self.parsers, generate.inputs, _active_tools(request))

    def _completion_input(self, request: CompletionRequest) -> GenerateInput:
        self._check(request.params)
        if not request.prompt:
            raise ValidationError("prompt", "prompt must not be empty")
        return self._input(request.params, request.prompt, None)

    def _header(self, prefix: str, request_id: str, adapter: str | None = None
                ) -> ResponseHeader:
        """`model` in the response: the LoRA adapter's name when the request named one."""
        return ResponseHeader(
            f"{prefix}-{request_id}", int(time.time()), adapter or self.model_id,
            self.system_fingerprint,
        )

    # --- unary -----------------------------------------------------------------------------

    async def chat(
        self,
        request: ChatRequest,
        *,
        request_id: str,
        deadline: float | None,
        method: str = CHAT_COMPLETIONS,
    ) -> Completed:
        """`method`: the route's metrics label (the Responses and Messages routes run here)."""
        generate = await _openai_errors(self._chat_input(request), "messages")
        params = replace(request.params, tool_calls=bool(_active_tools(request)))
        return await self._complete(
            generate, params, "chatcmpl", method, request_id, deadline,
            self._parsing(request, generate),
        )

    async def count_prompt_tokens(self, request: ChatRequest) -> int:
        """Tokens of the request's rendered prompt (validated as `chat` would, not run)."""
        generate = await _openai_errors(self._chat_input(request), "messages")
        return len(generate.prompt_ids or ())

    async def completion(
        self, request: CompletionRequest, *, request_id: str, deadline: float | None
    ) -> Completed:
        generate = self._completion_input(request)
        completed = await self._complete(
            generate, request.params, "cmpl", COMPLETIONS, request_id, deadline
        )
        if request.echo:
            choices = tuple(replace(c, text=request.prompt + c.text) for c in completed.choices)
            completed = replace(completed, choices=choices)
        return completed

    async def _complete(
        self,
        generate: GenerateInput,
        params: SamplingRequest,
        prefix: str,
        method: str,
        request_id: str,
        deadline: float | None,
        parsing: _Parsing | None = None,
    ) -> Completed:
        header = self._header(prefix, request_id, generate.adapter_id)
        prompt_param = "messages" if prefix == "chatcmpl" else "prompt"
        # n choices are n sequences run side by side (each admitted as a request of its own).
        calls = [
            _openai_errors(
                self.service.generate(
                    _nth(generate, i, params.n),
                    request_id=_nth_id(request_id, i, params.n),
                    deadline=deadline,
                    method=method,
                ),
                prompt_param,
            )
            for i in range(params.n)
        ]
        if len(calls) == 1:
            outcomes = [await calls[0]]
        else:
            try:
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(call) for call in calls]
            except BaseExceptionGroup as group_error:
                raise group_error.exceptions[0] from None
            outcomes = [t.result() for t in tasks]
        sequences = [o.best for o in outcomes]
        choices = tuple(self._choice(i, s, params, parsing) for i, s in enumerate(sequences))
        usage = Usage(outcomes[0].options.input_length, sum(s.generated_tokens for s in sequences))
        return Completed(header, choices, usage)

    def _choice(
        self, index: int, seq: GeneratedSequence, params: SamplingRequest,
        parsing: _Parsing | None = None,
    ) -> Choice:
        text = seq.generated_text
        stop = None
        if parsing is not None and parsing.markers:
            # A format's marker tokens may be special tokens: read them too.
            text = "".join(t.text for t in seq.tokens if not t.special or parsing.keeps(t))
        if seq.finish_reason is FinishReason.STOP_SEQUENCE:
            cut, stop = cut_at_stop(text, params.stop), stop_at(text, params.stop)
            text = text if cut is None else text[:cut]
        logprobs = None
        if params.logprobs:
            tops = seq.top_tokens or tuple(() for _ in seq.tokens)
            logprobs = tuple(
                _logprob(t, top) for t, top in zip(seq.tokens, tops, strict=True) if not t.special
            )
        reason = FINISH_REASONS[seq.finish_reason]
        if parsing is None:
            return Choice(index, text, reason, logprobs, stop_sequence=stop)
        out = parse_output(text, parsing.parsers.reasoning, parsing.tool_parser,
                           prompt=parsing.prompt, tools=parsing.tools)  # fmt: skip
        if out.tool_calls:
            calls = tuple(ToolCall(c.id, c.name, c.arguments) for c in out.tool_calls)
            if seq.finish_reason is not FinishReason.LENGTH:
                reason = TOOL_CALLS
            return Choice(index, out.content, reason, None, calls, out.reasoning, stop)
        return Choice(index, out.content, reason, logprobs, reasoning=out.reasoning,
                      stop_sequence=stop)

    # --- streams ---------------------------------------------------------------------------

    async def chat_stream(
        self,
        request: ChatRequest,
        *,
        request_id: str,
        deadline: float | None,
        method: str = CHAT_COMPLETIONS_STREAM,
    ) -> tuple[ResponseHeader, AsyncIterator[StreamEvent]]:
        """Validates and renders the request (errors raise here, before any chunk), then
        returns the stream's header (with the prompt's token count) and its events."""
        generate = await _openai_errors(self._chat_input(request), "messages")
        header = replace(
            self._header("chatcmpl", request_id, generate.adapter_id),
            prompt_tokens=len(generate.prompt_ids or ()),
        )
        params = replace(request.params, tool_calls=bool(_active_tools(request)))
        events = self._stream(generate, params, method, request_id, deadline,
                              parsing=self._parsing(request, generate))  # fmt: skip
        return header, events

    async def completion_stream(
        self, request: CompletionRequest, *, request_id: str, deadline: float | None
    ) -> tuple[ResponseHeader, AsyncIterator[StreamEvent]]:
        generate = self._completion_input(request)
        header = self._header("cmpl", request_id, generate.adapter_id)
        echo = request.prompt if request.echo else ""
        events = self._stream(
            generate, request.params, COMPLETIONS_STREAM, request_id, deadline, echo
        )
        return header, events

    async def _stream(
        self,
        generate: GenerateInput,
        params: SamplingRequest,
        method: str,
        request_id: str,
        deadline: float | None,
        echo: str = "",
        parsing: _Parsing | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        """The chunks of all choices (n sequences streamed side by side), then usage when asked.
        Validation errors surface on the first iteration, before anything is sent."""
        choices = [
            self._choice_stream(
                i, _nth(generate, i, params.n), params, method, _nth_id(request_id, i, params.n),
                deadline, echo, parsing,
            )
            for i in range(params.n)
        ]  # fmt: skip
        prompt_tokens = completion_tokens = 0
        async with aclosing(_merge(choices) if len(choices) > 1 else choices[0]) as events:
            async for event in events:
                if isinstance(event, _ChoiceDone):
                    prompt_tokens = event.prompt_tokens
                    completion_tokens += event.completion_tokens
                    continue
                yield event
        if params.include_usage:
            yield UsageChunk(Usage(prompt_tokens, completion_tokens))

    async def _choice_stream(
        self,
        index: int,
        generate: GenerateInput,
        params: SamplingRequest,
        method: str,
        request_id: str,
        deadline: float | None,
        echo: str,
        parsing: _Parsing | None,
    ) -> AsyncGenerator[ChoiceDelta | _ChoiceDone, None]:
        """One choice's chunks: the first (chat: the role; an echoed prompt), one per token with
        text (or logprobs), the finish; then its token counts for the usage chunk."""
        items = self.service.stream(
            generate, request_id=request_id, deadline=deadline, method=method
        )
        trimmer = StopTrimmer(params.stop)
        parser = parsing.stream() if parsing is not None else None
        called = False  # some tool call completed
        first = True
        chat = parsing is not None  # chat completions (and the routes on them) parse outputs
        prompt_param = "messages" if chat else "prompt"
        async with aclosing(items):
            events = _openai_errors_iter(items, prompt_param)
            async for item in events:
                if first:
                    # Chat announces the role in a first chunk; completions only echo there.
                    if chat or echo:
                        yield ChoiceDelta(index, echo, first=True)
                    first = False
                # Tokens that queued up while the client read (or a speculative step's
                # several tokens) go out as ONE chunk: their texts concatenated, their
                # logprobs listed in order.
                chunk = _ChunkText()
                while True:
                    token = item.token
                    finished = item.finished
                    kept = not token.special or (parsing is not None and parsing.keeps(token))
                    text = trimmer.push(token.text) if kept else ""
                    if finished is not None:
                        text += trimmer.flush()
                    if parser is not None:
                        deltas = parser.feed(text)
                        if finished is not None:
                            deltas += parser.finish()
                        called |= chunk.add(deltas)
                        text = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
                    else:
                        chunk.texts.append(text)
                    if params.logprobs and not token.special and (parser is None or text):
                        chunk.logprobs.append(_logprob(token, item.top_tokens))
                    if finished is not None or not item.backlog:
                        break
                    item = await anext(events)
                if not chunk.empty:
                    yield chunk.delta(index)
                if finished is None:
                    continue
                reason = FINISH_REASONS[finished.finish_reason]
                if called and finished.finish_reason is not FinishReason.LENGTH:
                    reason = TOOL_CALLS
                yield ChoiceDelta(index, "", finish_reason=reason, stop_sequence=trimmer.matched)
                yield _ChoiceDone(item.options.input_length, finished.generated_tokens)


def _active_tools(request: ChatRequest) -> tuple[FunctionTool, ...]:
    """The functions the output may call: none without tools or under tool_choice "none"; the
    named one under a named tool_choice."""
    choice = request.tool_choice or ToolChoice()
    if not request.tools or choice.mode == "none":
        return ()
    if choice.mode == "function":
        return tuple(t for t in request.tools if t.name == choice.function)
    return request.tools


class _ChunkText:
    """What one chunk of a choice carries: tokens that queued up while the client read (or a
    speculative step's several tokens) go out as ONE chunk."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCallChunk] = []
        self.logprobs: list[TokenLogprob] = []

    def add(self, deltas: list[OutputDelta]) -> bool:
        """Takes parser deltas; True when a tool call completed among them (the choice then
        finishes "tool_calls", as its unary answer would)."""
        completed = False
        for d in deltas:
            if isinstance(d, ContentDelta):
                self.texts.append(d.text)
            elif isinstance(d, ReasoningDelta):
                self.reasoning.append(d.text)
            elif isinstance(d, ToolCallStart):
                self.calls.append(ToolCallChunk(d.index, d.id, d.name, ""))
            elif isinstance(d, ToolCallArgumentsDelta):
                last = self.calls[-1] if self.calls else None
                if last is not None and last.index == d.index:
                    self.calls[-1] = replace(last, arguments=last.arguments + d.text)
                else:
                    self.calls.append(ToolCallChunk(d.index, None, None, d.text))
            elif isinstance(d, ToolCallEnd):
                # Nothing more to send (an incomplete call's pieces are already out).
                completed |= d.complete
        return completed

    @property
    def empty(self) -> bool:
        return not (any(self.texts) or any(self.reasoning) or self.calls or self.logprobs)

    def delta(self, index: int) -> ChoiceDelta:
        return ChoiceDelta(
            index, "".join(self.texts), logprobs=tuple(self.logprobs) or None,
            tool_calls=tuple(self.calls), reasoning="".join(self.reasoning),
        )  # fmt: skip


@dataclass(frozen=True)
class _ChoiceDone:
    """End of one streamed choice: its token counts (not sent; summed into the usage chunk)."""

    prompt_tokens: int
    completion_tokens: int


def _nth(generate: GenerateInput, index: int, n: int) -> GenerateInput:
    """Choice `index` of n: its own sequence, with seed `seed + index` when a seed was given."""
    if n == 1:
        return generate
    seed = None if generate.seed is None else (generate.seed + index) % (1 << 64)
    return replace(generate, seed=seed)


def _nth_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}/{index}"


async def _merge(
    streams: list[AsyncGenerator[_T, None]],
) -> AsyncGenerator[_T, None]:
    """The items of several async generators as they come. The first failure ends the merge
    (and closes the others); closing the merge closes them all."""
    queue: asyncio.Queue[tuple[int, _T | None, Exception | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[_T, None]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    await queue.put((i, item, None))
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, None, error))
            return
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            _, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                running -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def openai_param(field: str, prompt_param: str) -> str:
    """The OpenAI parameter that a validator field name stands for."""
    if field == "inputs":
        return prompt_param
    return _PARAMS.get(field, field.removeprefix("parameters."))


def _rename(error: ValidationError, prompt_param: str) -> ValidationError:
    param = openai_param(error.field, prompt_param)
    if param == error.field:
        return error
    message = str(error).replace(error.field, param)
    if error.field == "parameters.max_new_tokens":
        message = message.replace("max_new_tokens", param)
    return ValidationError(param, message)


async def _openai_errors(awaitable: Awaitable[_T], prompt_param: str) -> _T:
    """Awaits, renaming a validator's field names to OpenAI's parameter names."""
    try:
        return await awaitable
    except ValidationError as error:
        raise _rename(error, prompt_param) from None


async def _openai_errors_iter(
    items: AsyncIterator[_T], prompt_param: str
) -> AsyncGenerator[_T, None]:
    try:
        async for item in items:
            yield item
    except ValidationError as error:
        raise _rename(error, prompt_param) from None
