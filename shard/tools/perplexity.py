"""Perplexity on a fixed English text every Python ships, for quality checks of trained models.

The text is `pydoc_data.topics.topics` (the help() topics of the Python that runs this: ~465k
characters of English prose with code), its entries joined in sorted key order. The same
tokenizer and token count give the same tokens on every machine with the same Python minor
version.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Protocol


class Tokenizer(Protocol):
    """What is used of a `tokenizers.Tokenizer` (or a transformers tokenizer's backend)."""

    def encode(self, sequence: str, add_special_tokens: bool = ...): ...


def reference_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def reference_prefix(tokenizer: Tokenizer, num_tokens: int) -> str:
    """The longest prefix of reference_text() ending at a token boundary within its first
    `num_tokens` tokens (without special tokens): a prompt of ~num_tokens tokens that
    re-tokenizes the same way, since it ends where a token ended."""
    text = reference_text()
    encoding = tokenizer.encode(text, add_special_tokens=False)
    end = encoding.offsets[min(num_tokens, len(encoding.offsets)) - 1][1]
    return text[:end]


def reference_windows(tokenizer: Tokenizer, num_tokens: int, window: int) -> list[str]:
    """reference_prefix(tokenizer, num_tokens) cut at token boundaries into consecutive texts of
    ~`window` tokens each: the same text scored with a context of at most `window` tokens (what a
    server with a --max-input-tokens of `window` can take)."""
    text = reference_prefix(tokenizer, num_tokens)
    offsets = tokenizer.encode(text, add_special_tokens=False).offsets
    cuts = [offsets[min(w, len(offsets)) - 1][1] for w in range(window, num_tokens, window)]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def perplexity(logprobs: Sequence[float]) -> float:
    """exp of the mean negative log-likelihood (nats) of the scored tokens."""
    return math.exp(-sum(logprobs) / len(logprobs))
