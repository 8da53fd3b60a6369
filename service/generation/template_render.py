"""A model's chat template rendered with Jinja2 directly, the way Hugging Face templates expect,
without importing transformers (which brings torch: ~350 MiB of resident memory in every router
process, measured; see benchmarks/SOAK.md).

What a Hub chat template may rely on, and what this module gives it (the conventions of
transformers' `apply_chat_template`, which the model authors test their templates against):
- a sandboxed environment (templates are untrusted code from the model repository) with
  `trim_blocks` and `lstrip_blocks`, and the `loopcontrols` extension (`break`, `continue`);
- `raise_exception(message)` to reject a conversation, `strftime_now(format)` for dates, and a
  `tojson` filter that keeps non-ASCII text as is and takes `indent` / `separators` / `sort_keys`;
- the `{% generation %}` block tag, rendered as its body (it only marks assistant text);
- variables: `messages`, `tools` (when given), `add_generation_prompt`, and the special tokens
  of tokenizer_config.json (`bos_token`, `eos_token`, `unk_token`, `pad_token`, ...).
The template comes from chat_template.jinja, else from tokenizer_config.json's `chat_template`
(a string, or a list of named templates: "tool_use" when tools are declared and it exists, else
"default"). Token ids come from the model's tokenizer.json (tokenizers), without adding special
tokens again: a template writes its own.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateRejected(Exception):
    """The template raised (its own `raise_exception`, or a Jinja error while rendering)."""


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise TemplateRejected(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )  # fmt: skip
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken-like dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


@dataclass(frozen=True)
class ModelTemplates:
    """The chat templates and special tokens a model directory declares."""

    templates: dict[str, str]  # name -> template text ("default" for the only one)
    special_tokens: dict[str, str]  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}

    @classmethod
    def read(cls, model_dir: Path) -> ModelTemplates:
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        templates: dict[str, str] = {}
        declared = config.get("chat_template")
        if isinstance(declared, str):
            templates["default"] = declared
        elif isinstance(declared, list):  # [{"name": ..., "template": ...}, ...]
            for item in declared:
                if isinstance(item, dict) and isinstance(item.get("template"), str):
                    templates[str(item.get("name", "default"))] = item["template"]
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text()
        special = {
            key: text
            for key, value in config.items()
            if key.endswith("_token") and (text := _token_text(value)) is not None
        }
        return cls(templates, special)

    def pick(self, with_tools: bool) -> str | None:
        if with_tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        return self.templates.get("default") or next(iter(self.templates.values()), None)


class TemplateRenderer:
    """Renders conversations with one template text; compiled once, reused by every request."""

    def __init__(self, template: str, special_tokens: dict[str, str]) -> None:
        try:
            self._template = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as error:
            raise TemplateRejected(f"the chat template does not compile: {error}") from None
        self._special = dict(special_tokens)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        variables: dict[str, Any] = {
            **self._special, "messages": messages, "add_generation_prompt": add_generation_prompt,
        }  # fmt: skip
        if tools:
            variables["tools"] = tools
        try:
            return self._template.render(**variables)
        except TemplateRejected:
            raise
        except Exception as error:  # noqa: BLE001 - a template may raise anything
            raise TemplateRejected(str(error) or type(error).__name__) from None
