"""Chat templates: a conversation rendered into the model's prompt by the model's own Jinja
template (or the one of --chat-template FILE), on a worker thread so that the event loop never
renders. service/generation/template_render.py renders it as transformers' `apply_chat_template`
does, without importing transformers (and torch) into the router; the prompt's token ids come from
the model's tokenizer.json, without adding special tokens again (the template writes its own).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from service.generation.errors import ValidationError
from service.generation.template_render import (
    ModelTemplates,
    TemplateRejected,
    TemplateRenderer,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer


class Message(Protocol):
    """What a template sees of one message."""

    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str: ...

    @property
    def name(self) -> str | None: ...

    @property
    def tool_call_id(self) -> str | None: ...

    @property
    def tool_calls(self) -> tuple[Call, ...]: ...

    @property
    def images(self) -> tuple[tuple[int, Any], ...]:
        """Image parts: (offset in content where each sits, the image)."""
        ...


class Call(Protocol):
    """One tool call of an assistant message."""

    @property
    def id(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def arguments(self) -> str: ...


class Tool(Protocol):
    """One declared function."""

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str | None: ...

    @property
    def parameters(self) -> dict[str, Any]: ...


# For templates that know nothing of tools: how calls are declared to the model and written
# back in the conversation (the same `<tool_call>` blocks the tool grammar produces).
TOOLS_PROMPT = (
    "You can call functions to help with the request. Their signatures, one JSON object per "
    "line:\n<tools>\n{tools}\n</tools>\n\nTo call a function, answer with one block per "
    "call and nothing else:\n<tool_call>\n{{\"name\": <function name>, \"arguments\": "
    "<arguments object>}}\n</tool_call>"
)


def _tool_json(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = tool.parameters
    return {"type": "function", "function": function}


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call_block(call: Call) -> str:
    body = json.dumps({"name": call.name, "arguments": _arguments(call.arguments)})
    return f"<tool_call>\n{body}\n</tool_call>"


def has_chat_template(tokenizer_dir: Path) -> bool:
    """Whether the model directory ships a chat template (transformers' two places for it)."""
    if (tokenizer_dir / "chat_template.jinja").is_file():
        return True
    config = tokenizer_dir / "tokenizer_config.json"
    return config.is_file() and '"chat_template"' in config.read_text(errors="replace")


class ChatTemplate:
    """Renders conversations for one model directory."""

    def __init__(self, tokenizer_dir: Path, template_file: Path | None = None) -> None:
        self._dir = tokenizer_dir
        # Read at startup so that a wrong --chat-template path fails the router at once.
        self._override = template_file.read_text() if template_file is not None else None
        self._loaded: tuple[ModelTemplates, Tokenizer] | None = None
        self._renderers: dict[str, TemplateRenderer] = {}  # template text -> compiled renderer
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chat-template")
        # Load in the background now when there is a template to serve, so the first chat
        # request does not wait for it (a failure here is raised again, and reported, by that
        # request's own load).
        if self._override is not None or has_chat_template(tokenizer_dir):
            self._executor.submit(self._load)

    def _load(self) -> tuple[ModelTemplates, Tokenizer]:
        with self._lock:
            if self._loaded is None:
                from tokenizers import Tokenizer

                self._loaded = (
                    ModelTemplates.read(self._dir),
                    Tokenizer.from_file(str(self._dir / "tokenizer.json")),
                )
            return self._loaded

    def source(self) -> str | None:
        """The template that tool-using chats render with (its text tells which tool-call
        format the model was taught: --tool-call-parser auto)."""
        return self._override or ModelTemplates.read(self._dir).pick(with_tools=True)

    def _renderer(self, template: str, special_tokens: dict[str, str]) -> TemplateRenderer:
        renderer = self._renderers.get(template)
        if renderer is None:  # at most two: the model's default and tool_use templates
            try:
                renderer = TemplateRenderer(template, special_tokens)
            except TemplateRejected as error:
                raise ValidationError("messages", str(error)) from None
            self._renderers[template] = renderer
        return renderer

    def _render_sync(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], image_token: str = ""
    ) -> tuple[str, tuple[int, ...]]:
        templates, tokenizer = self._load()
        template = self._override or templates.pick(with_tools=bool(tools))
        if not template:
            raise ValidationError(
                "messages",
                "this model has no chat template (its tokenizer_config.json has none): start "
                "the router with --chat-template FILE to serve chat completions",
            )
        messages = _with_images(messages, _knows_images(template or ""), image_token)
        declared: list[dict[str, Any]] | None = None
        if _knows_tools(template):
            messages = [{k: v for k, v in m.items() if k != "_blocks"} for m in messages]
            declared = tools or None
        else:
            messages = _tools_as_text(messages, tools)
        try:
            prompt = self._renderer(template, templates.special_tokens).render(messages, declared)
        except TemplateRejected as error:
            raise ValidationError(
                "messages", f"the chat template rejected the messages: {error}"
            ) from None
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        return prompt, tuple(ids)

    async def render(
        self, messages: tuple[Message, ...], tools: tuple[Tool, ...] = (), image_token: str = ""
    ) -> tuple[str, tuple[int, ...]]:
        """The prompt text and its token ids, with the assistant's turn opened. `tools`: the
        functions the model may call (declared through the template's own `tools` support, or
        in a system message when it has none). A message's images: `{"type": "image"}` parts
        of a content list for a template that renders image parts itself, else `image_token`
        in the text at their places."""
        payload: list[dict[str, Any]] = []
        for m in messages:
            item: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.images:
                item["_parts"] = _parts(m.content, [at for at, _ in m.images])
            if m.name is not None:
                item["name"] = m.name
            if m.tool_call_id is not None:
                item["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                item["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": _arguments(c.arguments)},
                    }
                    for c in m.tool_calls
                ]
                item["_blocks"] = "\n".join(_call_block(c) for c in m.tool_calls)
            payload.append(item)
        declared = [_tool_json(t) for t in tools]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._render_sync, payload, declared,
                                          image_token)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _parts(text: str, offsets: list[int]) -> list[dict[str, str]]:
    """OpenAI-style content parts: the text cut at each image's offset, an image part there."""
    parts: list[dict[str, str]] = []
    cut = 0
    for at in offsets:
        if text[cut:at]:
            parts.append({"type": "text", "text": text[cut:at]})
        parts.append({"type": "image"})
        cut = at
    if text[cut:]:
        parts.append({"type": "text", "text": text[cut:]})
    return parts


def _knows_images(template: str) -> bool:
    """Whether a template renders image content parts itself (vision-language models' templates
    test a part's type against "image")."""
    return re.search(r"""['"]image['"]""", template) is not None


def _with_images(messages: list[dict[str, Any]], parts: bool, image_token: str
                 ) -> list[dict[str, Any]]:
    """Messages with images: their content as parts (a template that renders image parts), or
    their text with `image_token` at each image's place (any other template)."""
    out = []
    for m in messages:
        if "_parts" in m:
            m = dict(m)
            found = m.pop("_parts")
            m["content"] = found if parts else "".join(
                p["text"] if p["type"] == "text" else image_token for p in found)
        out.append(m)
    return out


def _knows_tools(template: str) -> bool:
    """Whether a template renders tools and tool calls itself (it reads `tools` / `tool_calls`)."""
    return "tools" in template and "tool_calls" in template


def _tools_as_text(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The conversation for a template without tool support: the declarations join the system
    message, an assistant's calls become its text (`<tool_call>` blocks) and a tool's answer a
    `<tool_response>` block."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        blocks = m.pop("_blocks", None)
        if blocks:
            m["content"] = (m["content"] + "\n" if m["content"] else "") + blocks
        if m["role"] == "tool":
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
        out.append(m)
    if tools:
        prompt = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t["function"]) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
