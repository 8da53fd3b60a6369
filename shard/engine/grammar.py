"""Grammar-constrained decoding on the shard, with llguidance (benchmarks/STRUCTURED.md says why
this library): one matcher per constrained sequence, a token bitmask per step.

Data flow of one step (shard/engine/batches.py drives it):

1. before the forward pass is launched, `GrammarEngine.start` hands the constrained rows to one
   mask thread; it lets each matcher consume the tokens sampled since its last mask (in
   parallel, `LLExecutor.consume_token_par`), then fills their rows of a host bitmask (the
   executor's parallel fill: the library's own thread pool, without the GIL). Rows of
   unconstrained sequences stay all ones;
2. the model thread meanwhile runs the forward pass (on CUDA it only queues kernels and waits);
3. `MaskJob.wait` joins the thread and copies the bitmask to the device (pinned, non-blocking);
   `apply_token_bitmask` sets the logits of disallowed tokens to -inf before sampling;
4. the sampled token is appended to the sequence's `GrammarState.pending`; the next step's mask
   job consumes it (so the matcher's advance is also off the critical path).

A grammar that is complete allows only the end-of-sequence tokens, so the sequence finishes with
the EOS finish reason one step later (batches.py also ends a constrained row on EOS when the
request ignores EOS: a finished grammar allows nothing else).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import tokenizers
import torch

from shard.errors import InvalidRequestError

GRAMMAR_KINDS = ("json_schema", "regex", "lark")
# Compiled grammars kept per shard (each holds its lexer and parser tables; a few hundred KB).
DEFAULT_CACHE_SIZE = 256


@dataclass(frozen=True)
class GrammarSpec:
    """An output constraint as the router sent it (already compiled once there).

    kind: "json_schema" (source: the schema as JSON text, llguidance options in "x-guidance"),
    "regex" (a regular expression the whole output must match) or "lark" (llguidance's Lark
    dialect: tool calls).
    """

    kind: str
    source: str

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()


def llguidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar text of a spec (no validation: the matcher reports errors)."""
    from llguidance import LLMatcher

    if spec.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec.source)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "lark":
        return LLMatcher.grammar_from_lark(spec.source)
    raise InvalidRequestError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}; got {spec.kind!r}")


def build_tokenizer(tokenizer: tokenizers.Tokenizer, vocab_size: int, eos_token_id: int):
    """llguidance's view of the model's tokenizer: each id's bytes, `vocab_size` entries (the LM
    head's width, which may exceed the tokenizer's), `eos_token_id` as the end of a grammar."""
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos_token_id)


@dataclass
class GrammarState:
    """One constrained sequence: its matcher and the sampled tokens it has not consumed yet."""

    matcher: object  # llguidance.LLMatcher
    pending: list[int] = field(default_factory=list)


class MaskJob:
    """The bitmask of one step, being filled on the mask thread."""

    def __init__(self, future: Future[None], bitmask: torch.Tensor) -> None:
        self._future = future
        self.bitmask = bitmask  # [num_rows, ceil(vocab / 32)] int32, host (pinned on CUDA)

    def join(self) -> None:
        """Waits for the fill, ignoring its outcome."""
        try:
            self._future.result()
        except Exception:  # noqa: BLE001 - the step failed anyway
            pass

    def wait(self, device: torch.device) -> torch.Tensor:
        """Joins the fill and returns the bitmask on `device` ([num_rows, words] int32)."""
        self._future.result()
        if device.type != "cuda":
            return self.bitmask
        return self.bitmask.to(device, non_blocking=True)


class GrammarEngine:
    """Compiles grammars (cached by content hash, bounded) and fills a step's bitmask."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        vocab_size: int,
        eos_token_ids: set[int],
        *,
        pin_memory: bool = False,
        threads: int | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.words = (vocab_size + 31) // 32  # int32 words of one bitmask row
        self._pin = pin_memory
        # The library's pool fills rows in parallel; half the cores leaves the rest to the
        # model thread and the server (at least one, at most 16).
        self._threads = threads or max(1, min(16, (os.cpu_count() or 2) // 2))
        self._cache_size = cache_size
        self._templates: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer = None
        self._executor = None
        # One thread: a step's fill runs beside the forward pass, never beside another fill.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._buffer: torch.Tensor | None = None

    def _ll(self):
        """The llguidance tokenizer and executor, built on first use (warmup calls it)."""
        with self._lock:
            if self._tokenizer is None:
                from llguidance import LLExecutor

                eos = self.eos_token_ids[0] if self.eos_token_ids else None
                self._tokenizer = build_tokenizer(self._hf_tokenizer, self.vocab_size, eos)
                self._executor = LLExecutor(self._threads)
            return self._tokenizer, self._executor

    def prepare(self) -> None:
        """Starts building the tokenizer view on the mask thread (up to a second for large
        vocabularies), so that the first constrained request does not wait for it."""
        self._thread.submit(self._ll)

    def _template(self, spec: GrammarSpec):
        key = spec.key
        with self._lock:
            found = self._templates.get(key)
            if found is not None:
                self._templates.move_to_end(key)
                return found
        from llguidance import LLMatcher

        try:
            tokenizer, _ = self._ll()
        except ValueError as error:  # e.g. a WordPiece decoder: no byte view of the tokens
            raise InvalidRequestError(
                f"grammar: this model's tokenizer cannot be used for constrained generation "
                f"({error})"
            ) from None
        matcher = LLMatcher(tokenizer, llguidance_grammar(spec), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"grammar: {matcher.get_error()}")
        with self._lock:
            self._templates[key] = matcher
            while len(self._templates) > self._cache_size:
                self._templates.popitem(last=False)
        return matcher

    def check(self, spec: GrammarSpec) -> None:
        """Compiles the grammar (or finds it cached); raises InvalidRequestError when it is bad."""
        self._template(spec)

    def new_state(self, spec: GrammarSpec, generated: list[int]) -> GrammarState:
        """A fresh matcher for a sequence; `generated` (tokens generated before a preemption)
        is replayed by the next mask job."""
        return GrammarState(self._template(spec).deep_copy(), list(generated))

    def start(self, rows: list[tuple[int, GrammarState]], num_rows: int) -> MaskJob:
        """Starts filling the bitmask of a step with `num_rows` sampled rows, of which `rows`
        (row index, state) are constrained."""
        bitmask = self._rows(num_rows)
        future = self._thread.submit(self._fill, rows, bitmask)
        return MaskJob(future, bitmask)

    def _rows(self, num_rows: int) -> torch.Tensor:
        # One host buffer, grown on demand: the previous step's copy to the device has finished
        # before this one starts (sampling ended it with a device-to-host copy).
        buf = self._buffer
        if buf is None or buf.shape[0] < num_rows:
            buf = torch.empty((max(num_rows, 8), self.words), dtype=torch.int32)
            if self._pin:
                buf = buf.pin_memory()
            self._buffer = buf
        return buf[:num_rows]

    def _fill(self, rows: list[tuple[int, GrammarState]], bitmask: torch.Tensor) -> None:
        _, executor = self._ll()
        if len(rows) < bitmask.shape[0]:
            bitmask.fill_(-1)  # unconstrained rows: every token allowed
        singles = []
        for _, state in rows:
            pending = state.pending
            if len(pending) == 1:
                singles.append((state.matcher, pending[0]))
            elif pending:  # a replay after preemption
                state.matcher.consume_tokens(pending)
            state.pending = []
        if singles:
            executor.consume_token_par(singles)
        # llguidance.torch.fill_next_token_bitmask_par does exactly this call; importing that
        # module would import torch.compile's machinery (seconds) for its apply kernel.
        executor.unsafe_compute_mask_ptr(
            [(s.matcher, row) for row, s in rows],
            bitmask.data_ptr(),
            self.words * 4,  # bytes of one row
            bitmask.shape[0],
        )
        eos = self.eos_token_ids
        for row, state in rows:
            matcher = state.matcher
            if matcher.is_error():
                # A token the grammar refused (cannot happen under the mask) or a limit hit:
                # end the sequence rather than sample from nothing.
                bitmask[row].zero_()
                _allow(bitmask, row, eos)
            elif len(eos) > 1 and matcher.is_accepting():
                _allow(bitmask, row, eos)  # any of the model's EOS tokens ends the grammar

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def _allow(bitmask: torch.Tensor, row: int, tokens: list[int]) -> None:
    for t in tokens:
        word, bit = divmod(t, 32)
        if word < bitmask.shape[1]:
            value = int(bitmask[row, word]) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets the logits of disallowed tokens to -inf, in place.

    logits: [n, vocab] float on the device; bitmask: [n, ceil(vocab / 32)] int32 on the same
    device, bit j of word w allowing token 32 * w + j. Four element-wise kernels: llguidance's
    own apply is torch.compile'd, which on a CPU shard builds C++ at first use.
    """
    n, vocab = logits.shape
    with torch.inference_mode():  # the logits are the forward pass's inference tensors
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        bits = (bitmask[:, :, None] >> shifts) & 1  # [n, words, 32]
        allowed = bits.view(n, -1)[:, :vocab].bool()  # [n, vocab]
        logits.masked_fill_(~allowed, float("-inf"))
