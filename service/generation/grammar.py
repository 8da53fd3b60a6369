"""Output grammars: TGI's `parameters.grammar`, OpenAI's `response_format` and tool calls become
`GrammarSpec`s (the form the shards receive; each tool-call format builds its own, in
`service.generation.parsers`), and each distinct grammar is compiled once with
llguidance against the model's tokenizer before its request is queued.

A grammar that does not compile, or that no output can satisfy, is a ValidationError naming the
request field and what is wrong. Compiling runs on a worker thread (never on the event loop);
results (success or the error) are cached by content hash in a bounded LRU map, and concurrent
requests with the same new grammar share one compilation.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.engine.contracts import GrammarSpec
from service.generation.errors import UnsupportedError, ValidationError

_log = logging.getLogger("tokenwire.router")

# JSON the way models write it (json.dumps' separators), without free whitespace: a small model
# given free whitespace can emit newlines until max_new_tokens.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
DEFAULT_CACHE_SIZE = 1024
FUNCTION_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def integral(value: Any) -> Any:
    """`value` with every integral float made an int: schemas that crossed protobuf's Struct
    (gRPC, Envoy's JSON transcoding) carry numbers as doubles, and `"maxLength": 8.0` is not a
    valid schema keyword value."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [integral(v) for v in value]
    return value


def json_schema_spec(schema: dict[str, Any], *, strict: bool = True) -> GrammarSpec:
    """A JSON-schema constraint. strict: a keyword the compiler does not implement is an error
    (TGI, OpenAI's strict); otherwise it is ignored (lenient)."""
    schema = integral(schema)
    options = {**JSON_OPTIONS, "lenient": not strict}
    user = schema.get("x-guidance")
    if isinstance(user, dict):
        options.update(user)
    doc = {**schema, "x-guidance": options}
    # Key order is kept: the grammar writes properties in the schema's order.
    return GrammarSpec("json_schema", json.dumps(doc, separators=(",", ":")))


def regex_spec(pattern: str) -> GrammarSpec:
    return GrammarSpec("regex", pattern)


@dataclass(frozen=True)
class FunctionTool:
    """A declared function (OpenAI's tools[i].function)."""

    name: str
    description: str | None
    parameters: dict[str, Any]  # JSON schema of the arguments object
    strict: bool = False


class GrammarCompiler:
    """Compiles grammars against the model's tokenizer (llguidance), off the event loop, with a
    bounded cache of outcomes keyed by the grammar's content hash."""

    def __init__(
        self,
        tokenizer_json: Path,
        vocab_size: int,
        eos_token_id: int | None,
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        path = tokenizer_json / "tokenizer.json" if tokenizer_json.is_dir() else tokenizer_json
        self._path = path
        self._vocab_size = vocab_size
        self._eos = eos_token_id
        self._cache_size = cache_size
        self._cache: OrderedDict[str, str | None] = OrderedDict()  # key -> error or None
        self._pending: dict[str, asyncio.Future[str | None]] = {}
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        # Build the tokenizer view in the background now, not on the first grammar request
        # (it holds the GIL for up to a second on large vocabularies: serve awaits `ready`
        # before it reports SERVING).
        self._built = self._executor.submit(self._ll_tokenizer)

    async def ready(self) -> None:
        """Waits until the tokenizer view is built. A tokenizer llguidance cannot read (e.g. a
        WordPiece decoder) only disables grammars: such requests get UNIMPLEMENTED."""
        try:
            await asyncio.wrap_future(self._built)
        except Exception as error:  # noqa: BLE001 - the server still serves everything else
            _log.warning("constrained generation unavailable for this tokenizer: %s", error)

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from llguidance import LLTokenizer

                self._tokenizer = LLTokenizer(
                    self._path.read_text(), n_vocab=self._vocab_size, eos_token=self._eos
                )
            return self._tokenizer

    def compile_sync(self, spec: GrammarSpec) -> str | None:
        """Compiles `spec`; returns what is wrong with it, or None when it is usable."""
        from llguidance import LLMatcher

        try:
            if spec.kind == "json_schema":
                grammar = LLMatcher.grammar_from_json_schema(spec.source)
            elif spec.kind == "regex":
                grammar = LLMatcher.grammar_from_regex(spec.source)
            else:
                grammar = LLMatcher.grammar_from_lark(spec.source)
        except ValueError as error:
            return f"is not valid: {error}"
        matcher = LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            return f"cannot be compiled: {_short(matcher.get_error())}"
        if not any(matcher.compute_bitmask()) or matcher.is_error():
            why = _short(matcher.get_error()) or "no token can start a matching output"
            return f"cannot be satisfied: {why}"
        return None

    async def check(self, spec: GrammarSpec, field: str) -> None:
        """Raises ValidationError(field, ...) when `spec` cannot be used."""
        key = hashlib.sha256(f"{spec.kind}\0{spec.source}".encode()).hexdigest()
        if key in self._cache:
            self._cache.move_to_end(key)
            error = self._cache[key]
        else:
            future = self._pending.get(key)
            if future is None:
                loop = asyncio.get_running_loop()
                future = asyncio.ensure_future(
                    loop.run_in_executor(self._executor, self.compile_sync, spec)
                )
                self._pending[key] = future
                future.add_done_callback(lambda _: self._pending.pop(key, None))
            try:
                error = await asyncio.shield(future)
            except Exception as failure:  # noqa: BLE001 - the tokenizer, not the grammar
                raise UnsupportedError(
                    f"{field}: constrained generation is not available for this model's "
                    f"tokenizer ({failure})"
                ) from None
            self._cache[key] = error
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        if error is not None:
            raise ValidationError(field, f"{field} {error}")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _short(message: str, limit: int = 400) -> str:
    """A library error message cut to one readable line."""
    line = " ".join(message.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
