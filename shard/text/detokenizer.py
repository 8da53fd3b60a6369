"""Incremental detokenization that never emits a broken UTF-8 character.

Decoding token by token is wrong in two ways: a byte-level BPE token may hold only part of a
multi-byte character (decoding it alone gives U+FFFD), and SentencePiece-style decoders drop the
leading space of the first token of a decode call. Both are avoided with two offsets into the
token list (the technique of TGI / vLLM):

    ids: ... | prefix_offset ........ read_offset ........ len(ids)
               already emitted context   | not yet emitted

Each push decodes ``ids[prefix_offset:read_offset]`` (text already emitted, kept as context) and
``ids[prefix_offset:]``; the new text is the second string minus the length of the first. While
the new text ends with U+FFFD (an incomplete UTF-8 sequence) nothing is emitted and the offsets
stay, so the next token completes the character. The window starts inside the prompt so the first
generated token keeps its leading space.

Special tokens (EOS, ...) are decoded to their content, like any token: the caller decides
whether to show them (:meth:`IncrementalDetokenizer.is_special`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tokenizers

REPLACEMENT = "\ufffd"
# Prompt tokens decoded as context before the first generated token: enough for a SentencePiece
# leading space and for a multi-byte character spread over several byte tokens.
PROMPT_CONTEXT = 5
# A UTF-8 character is at most 4 bytes and every token holds at least one, so text still ending
# in U+FFFD after this many held-back tokens is genuinely invalid (or a real U+FFFD): emit it
# rather than hold the stream forever.
MAX_HELD_TOKENS = 4


class IncrementalDetokenizer:
    """Turns one request's generated tokens into text, one token at a time."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, prompt_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._special_ids = _special_ids(tokenizer)
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        self._ids: list[int] = context  # context window + generated ids not yet behind prefix
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._chunks: list[str] = []

    def is_special(self, token_id: int) -> bool:
        """True for the tokenizer's special tokens (BOS, EOS, PAD, ...)."""
        return token_id in self._special_ids

    def push(self, token_id: int) -> str:
        """Adds a generated token; returns the new text it completes ('' while a character is
        incomplete). Concatenating every return value gives :attr:`text`."""
        self._ids.append(token_id)
        held = len(self._ids) - self._read_offset
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or (
            full_text.endswith(REPLACEMENT) and held < MAX_HELD_TOKENS
        ):
            return ""
        new_text = full_text[len(prefix_text) :]
        # Slide the window: what was unread becomes the context of the next push. Ids before the
        # new prefix are never decoded again, so drop them to keep the list short.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._chunks.append(new_text)
        return new_text

    def flush(self) -> str:
        """Emits whatever is held back at the end of generation (U+FFFD for an incomplete
        trailing character); call once, when the request finishes."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        if new_text:
            self._chunks.append(new_text)
        return new_text

    @property
    def text(self) -> str:
        """All generated text emitted so far (the concatenation of push results)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=False)


def _special_ids(tokenizer: tokenizers.Tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's added tokens marked special."""
    decoder = tokenizer.get_added_tokens_decoder()  # {id: AddedToken}
    return frozenset(i for i, tok in decoder.items() if tok.special)
