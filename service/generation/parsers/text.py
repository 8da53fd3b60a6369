"""Small text helpers that every streaming parser shares."""

from __future__ import annotations

import secrets
import string

_ALNUM = string.ascii_letters + string.digits


def held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could still grow into one of `markers` (a
    streaming parser holds those characters back until the next text decides)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def call_id() -> str:
    """A tool call id in OpenAI's shape."""
    return "call_" + secrets.token_hex(12)


def short_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates reject any other call id."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))
