"""Per-request stopping: EOS token, stop sequences, max_new_tokens.

Priority when several conditions hold on the same token: EOS first (the model itself ended the
text), then a stop sequence (the user's end marker), then length (the budget). The reason reported
to the client is therefore the most specific one.
"""

from __future__ import annotations

import enum

from shard.text.stop_strings import StopStringMatcher


class StopReason(enum.Enum):
    """Why a request finished; the values are the public API's finish_reason strings."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"


class StoppingCriteria:
    """Decides after each generated token whether the request is finished.

    One instance per request; :meth:`check` is called once per generated token, in order, with the
    whole generated text so far. Stop sequences are found by shard.text's StopStringMatcher (the
    router's front ends use the same one for the requests they detokenize themselves).
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
        self._stops = StopStringMatcher(stop_sequences)
        self.stop_sequences = self._stops.stop_sequences
        self.ignore_eos_token = ignore_eos_token

    @property
    def matched_stop(self) -> str | None:
        """The stop sequence that ended the request, if any."""
        return self._stops.matched_stop

    def check(self, token_id: int, generated_text: str, generated_count: int) -> StopReason | None:
        """Returns why the request stops after this token, or None to continue.

        token_id: the token just generated. generated_text: all generated text so far, this
        token's included (may lag behind while a UTF-8 sequence is incomplete). generated_count:
        number of generated tokens, this one included.
        """
        if not self.ignore_eos_token and token_id in self.eos_token_ids:
            return StopReason.EOS_TOKEN
        if self._stops.find(generated_text):
            return StopReason.STOP_SEQUENCE
        if generated_count >= self.max_new_tokens:
            return StopReason.LENGTH
        return None
