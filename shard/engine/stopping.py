"""Per-request stopping: EOS token, stop sequences, max_new_tokens.

Priority when several conditions hold on the same token: EOS first (the model itself ended the
text), then a stop sequence (the user's end marker), then length (the budget). The reason reported
to the client is therefore the most specific one.
"""

from __future__ import annotations

import enum


class StopReason(enum.Enum):
    """Why a request finished; the values are the public API's finish_reason strings."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"


class StoppingCriteria:
    """Decides after each generated token whether the request is finished.

    One instance per request; :meth:`check` is called once per generated token, in order, with the
    whole generated text so far. The instance remembers how much text it has already scanned, so
    a stop sequence is searched only in the tail that could contain a new occurrence: text added
    since the previous call, plus ``len(stop) - 1`` characters before it for occurrences that span
    tokens. A stop sequence inside a token's text (not only at the very end) is found too.
    """

    def __init__(
        self,
        eos_token_ids: set[int],
        max_new_tokens: int,
        stop_sequences: list[str],
        ignore_eos_token: bool = False,
    ) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_new_tokens = max_new_tokens
        # Empty strings would match everywhere; the router rejects them, skip them defensively.
        self.stop_sequences = [s for s in stop_sequences if s]
        self.ignore_eos_token = ignore_eos_token
        self._longest_stop = max((len(s) for s in self.stop_sequences), default=0)
        self._scanned = 0  # characters of generated_text already searched
        self.matched_stop: str | None = None  # the stop sequence that ended the request, if any

    def check(self, token_id: int, generated_text: str, generated_count: int) -> StopReason | None:
        """Returns why the request stops after this token, or None to continue.

        token_id: the token just generated. generated_text: all generated text so far, this
        token's included (may lag behind while a UTF-8 sequence is incomplete). generated_count:
        number of generated tokens, this one included.
        """
        if not self.ignore_eos_token and token_id in self.eos_token_ids:
            return StopReason.EOS_TOKEN
        if self._find_stop(generated_text):
            return StopReason.STOP_SEQUENCE
        if generated_count >= self.max_new_tokens:
            return StopReason.LENGTH
        return None

    def _find_stop(self, text: str) -> bool:
        if not self.stop_sequences:
            return False
        if len(text) < self._scanned:
            # The text shrank (a caller rebuilt it): nothing safe to assume, rescan from the start.
            self._scanned = 0
        start = max(0, self._scanned - self._longest_stop + 1)
        tail = text[start:]
        self._scanned = len(text)
        for stop in self.stop_sequences:
            if stop in tail:
                self.matched_stop = stop
                return True
        return False
