"""The router's text work for ids-only requests: tokens become text, and stop sequences end the
request, here (in the front end that streams it) instead of on the shard's step path.

The shard returns token ids, log-probabilities and specialness only (`ValidatedRequest.ids_only`,
shard Request field `ids_only`); each request's `TextStream` runs the shard's own algorithms
(shard.text: the incremental detokenizer and the stop-string matcher) on the events as the reader
takes them, so the texts, the finish reasons and the token counts are those the shard would have
produced:

- every generated token's text (incremental, never a broken UTF-8 character), the held-back
  text flushed into the last token's, the alternatives' and prompt tokens' texts (one-token
  decodes, as the shard's);
- a stop sequence ends the request at the token whose text completes it, with priority as on
  the shard: EOS (the shard's finish on that very token) before the stop sequence before
  `max_new_tokens`. The stream then asks the engine to stop the request (`RequestStream.stop`:
  removed like a cancel, its KV blocks freed), drops the tokens the shard computed meanwhile and
  ends with the engine's accounting (timings, prefix-cache hits, tokens per step) cut at the
  stop token.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from service.engine.contracts import (
    EngineError,
    Finished,
    FinishReason,
    RequestStream,
    StepEvent,
    TokenInfo,
    ValidatedRequest,
)
from shard.text.detokenizer import IncrementalDetokenizer
from shard.text.stop_strings import StopStringMatcher

if TYPE_CHECKING:
    import tokenizers


class RouterText:
    """The text work of one router process (one per front end): builds each ids-only request's
    TextStream and caches one-token texts (alternatives, prompt tokens)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self.tokenizer = tokenizer
        # One-token texts by id (bounded by the vocabulary): alternatives repeat a lot.
        self._pieces: dict[int, str] = {}

    def piece(self, token_id: int) -> str:
        """A token's text decoded alone, special tokens included (as the shard decodes the
        alternatives and the prompt tokens)."""
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return text

    def pieces(self, tokens: tuple[TokenInfo, ...]) -> tuple[TokenInfo, ...]:
        piece = self.piece
        return tuple(TokenInfo(t.id, piece(t.id), t.logprob, t.special) for t in tokens)

    def wrap(self, request: ValidatedRequest, stream: RequestStream) -> TextStream:
        return TextStream(self, request, stream)


def cut_tokens_per_step(steps: tuple[int, ...], n: int) -> tuple[int, ...]:
    """Tokens per step of the first `n` tokens (the step of the n-th token ends there, as the
    shard ends a verified step at the token that finishes the request)."""
    out: list[int] = []
    total = 0
    for k in steps:
        if total + k >= n:
            out.append(n - total)
            break
        out.append(k)
        total += k
    return tuple(out)


class TextStream:
    """A RequestStream of an ids-only request that yields the events with their texts (see the
    module docstring); `cancel` and `aclose` reach the engine's stream."""

    __slots__ = ("_count", "_detok", "_done", "_inner", "_pending", "_request", "_stops",
                 "_text", "_visible")  # fmt: skip

    def __init__(self, text: RouterText, request: ValidatedRequest, inner: RequestStream) -> None:
        self._text = text
        self._request = request
        self._inner = inner
        self._detok = IncrementalDetokenizer(text.tokenizer, list(request.input_ids))
        self._stops = StopStringMatcher(request.stopping.stop_sequences)
        self._visible: list[str] = []  # texts of the non-special tokens: the generated_text
        self._count = 0  # generated tokens so far
        # The last event after a stop sequence matched, waiting for the engine's accounting.
        self._pending: StepEvent | None = None
        self._done = False

    def __aiter__(self) -> TextStream:
        return self

    async def __anext__(self) -> StepEvent:
        if self._done:
            raise StopAsyncIteration
        while True:
            try:
                event = await self._inner.__anext__()
            except (StopAsyncIteration, EngineError):
                if self._pending is None:
                    raise
                # Stopped here, then the engine failed or drained before its last event: the
                # request did finish (the tokens up to the stop are all there).
                return self._end_stopped(None)
            if self._pending is not None:  # after the stop: tokens the shard computed meanwhile
                if event.finished is not None:
                    return self._end_stopped(event.finished)
                continue
            out = self._convert(event)
            if out is not None:
                return out

    def _convert(self, event: StepEvent) -> StepEvent | None:
        """The event with its texts; None when a stop sequence matched (the last event then
        waits in `_pending` for the engine's accounting)."""
        token = event.token
        detok = self._detok
        text = detok.push(token.id)
        self._count += 1
        if not token.special:
            self._visible.append(text)
        finished = event.finished
        stops = self._stops
        # The shard's priority: EOS (its finish on this very token; with ignore_eos_token only a
        # finished grammar ends on EOS, after the stop check) before the stop sequence.
        stopped = (
            stops.stop_sequences
            and (
                finished is None
                or finished.finish_reason is not FinishReason.EOS_TOKEN
                or self._request.stopping.ignore_eos_token
            )
            and stops.find(detok.text)
        )
        if not stopped and finished is None:  # the usual token: nothing else to do
            if event.top_tokens or event.prefill is not None:
                return StepEvent(
                    TokenInfo(token.id, text, token.logprob, token.special),
                    self._text.pieces(event.top_tokens),
                    None if event.prefill is None else self._text.pieces(event.prefill),
                )
            return StepEvent(TokenInfo(token.id, text, token.logprob, token.special))
        held_back = detok.flush()
        text += held_back
        self._visible.append(held_back)
        out = StepEvent(
            TokenInfo(token.id, text, token.logprob, token.special),
            self._text.pieces(event.top_tokens),
            None if event.prefill is None else self._text.pieces(event.prefill),
        )
        if stopped:
            if finished is None:  # the engine goes on until it stops the request
                self._pending = out
                self._inner.stop()
                return None
            finished = replace(finished, finish_reason=FinishReason.STOP_SEQUENCE)
        self._done = True
        return replace(out, finished=replace(finished, generated_text="".join(self._visible)))

    def _end_stopped(self, accounting: Finished | None) -> StepEvent:
        """The stop token's event, finished: the engine's accounting cut at this token."""
        self._done = True
        n = self._count
        if accounting is None:
            sampling = self._request.sampling
            finished = Finished(
                generated_text="",
                generated_tokens=n,
                finish_reason=FinishReason.STOP_SEQUENCE,
                seed=sampling.seed if sampling.do_sample else None,
            )
        else:
            finished = replace(
                accounting, tokens_per_step=cut_tokens_per_step(accounting.tokens_per_step, n)
            )
        event = self._pending
        assert event is not None
        self._pending = None
        return replace(event, finished=replace(
            finished,
            generated_text="".join(self._visible),
            generated_tokens=n,
            finish_reason=FinishReason.STOP_SEQUENCE,
        ))  # fmt: skip

    def ready(self) -> int:
        """Events the engine's stream holds for this one (RequestStream.ready of the coalescing
        front ends): each gives one event here, except after a stop sequence matched (the
        rest are dropped; the last event waits for the engine's accounting)."""
        return 0 if self._done or self._pending is not None else self._inner.ready()

    def cancel(self) -> None:
        self._done = True
        self._inner.cancel()

    def stop(self) -> None:
        self._inner.stop()

    async def aclose(self) -> None:
        self.cancel()
