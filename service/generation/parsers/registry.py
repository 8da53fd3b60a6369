"""Parsers by name (the `--reasoning-parser` and `--tool-call-parser` flags), and "auto": the
tool-call format a chat template's own text reveals."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from service.generation.parsers.contracts import ReasoningParser, ToolCallParser
from service.generation.parsers.hermes import HermesParser
from service.generation.parsers.llama3_json import Llama3JsonParser
from service.generation.parsers.mistral import MistralParser
from service.generation.parsers.pythonic import PythonicParser
from service.generation.parsers.qwen3_coder import Qwen3CoderParser
from service.generation.parsers.reasoning import NoReasoning, ThinkReasoning

if TYPE_CHECKING:
    from tokenizers import Tokenizer

REASONING_PARSERS: dict[str, Callable[[], ReasoningParser]] = {
    "none": NoReasoning,
    "think": ThinkReasoning,
}
TOOL_CALL_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "qwen3_coder": Qwen3CoderParser,
    "pythonic": PythonicParser,
}
AUTO = "auto"
DEFAULT_TOOL_CALL_PARSER = "hermes"
# What a chat template writes when it teaches its model a format, most specific first.
_TEMPLATE_SIGNS: tuple[tuple[str, str], ...] = (
    ("<function=", "qwen3_coder"),
    ("[TOOL_CALLS]", "mistral"),
    ("<tool_call>", "hermes"),
    ("<|python_start|>", "pythonic"),
    ("[func_name1(", "pythonic"),
    ("<|python_tag|>", "llama3_json"),
    ('{"name": function name, "parameters"', "llama3_json"),
)


def reasoning_parser(name: str) -> ReasoningParser:
    """The reasoning parser called `name` (KeyError names the choices)."""
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise KeyError(f"unknown reasoning parser {name!r}; choose one of "
                       f"{', '.join(REASONING_PARSERS)}") from None  # fmt: skip


def tool_format_of_template(template: str | None) -> str:
    """The tool-call format a chat template teaches its model, hermes when none is recognised."""
    for sign, name in _TEMPLATE_SIGNS:
        if template and sign in template:
            return name
    return DEFAULT_TOOL_CALL_PARSER


def tool_call_parser(name: str, chat_template: str | None = None) -> ToolCallParser:
    """The tool-call parser called `name`; "auto" reads it from `chat_template`."""
    if name == AUTO:
        name = tool_format_of_template(chat_template)
    try:
        return TOOL_CALL_PARSERS[name]()
    except KeyError:
        raise KeyError(f"unknown tool-call parser {name!r}; choose one of "
                       f"{', '.join([*TOOL_CALL_PARSERS, AUTO])}") from None  # fmt: skip


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """The tokenizer's special tokens, text -> id (a format's grammar writes its markers as
    these tokens; the chat path keeps their text for the parser)."""
    return {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
