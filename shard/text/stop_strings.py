"""Stop-sequence matching over a growing generated text.

Shared by the shard (shard.engine.stopping, for callers that want the shard to stop on text) and
the router (service.generation.text_stream, for requests it detokenizes itself).
"""

from __future__ import annotations


class StopStringMatcher:
    """Finds the first of several stop sequences in a text that only grows (one call per token).

    It remembers how much text it has already scanned, so a stop sequence is searched only in the
    tail that could contain a new occurrence: text added since the previous call, plus
    ``len(stop) - 1`` characters before it for occurrences that span tokens. A stop sequence
    inside a token's text (not only at the very end) is found too.
    """

    __slots__ = ("_longest_stop", "_scanned", "matched_stop", "stop_sequences")

    def __init__(self, stop_sequences: list[str] | tuple[str, ...]) -> None:
        # Empty strings would match everywhere; the router rejects them, skip them defensively.
        self.stop_sequences = [s for s in stop_sequences if s]
        self._longest_stop = max((len(s) for s in self.stop_sequences), default=0)
        self._scanned = 0  # characters of the text already searched
        self.matched_stop: str | None = None  # the stop sequence found, if any

    def find(self, text: str) -> bool:
        """True when `text` (all generated text so far, the newest token's included) contains a
        stop sequence; records it in `matched_stop`."""
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
