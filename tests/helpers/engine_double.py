"""A scripted `Engine` double for servicer-level tests (never for end-to-end tests).

Each request generates `max_new_tokens` tokens whose ids are a deterministic function of the
prompt, the position and (when sampling) the seed, so tests can predict every output.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from service.engine.contracts import (
    AdapterInfo,
    AdapterSource,
    EngineError,
    EngineStats,
    Finished,
    FinishReason,
    OverloadedError,
    StepEvent,
    TokenInfo,
    ValidatedRequest,
)

EOS_ID = 2


def token_id(request: ValidatedRequest, position: int) -> int:
    """The id the double generates at `position` (never EOS, never below 10)."""
    salt = request.sampling.seed % 97 if request.sampling.do_sample else 0
    return 10 + (sum(request.input_ids) + 7 * position + salt) % 50


def token_text(token: int) -> str:
    return f"t{token} "


def token_logprob(token: int) -> float:
    return -0.01 - 0.1 * (token % 5)


def expected_text(request: ValidatedRequest) -> str:
    """What the double's generated_text is for `request` (finish reason length)."""
    n = request.stopping.max_new_tokens
    return "".join(token_text(token_id(request, i)) for i in range(n))


@dataclass
class _Stream:
    engine: ScriptedEngine
    request: ValidatedRequest
    cancelled: bool = False

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.engine.cancelled.append(self.request.request_id)

    def ready(self) -> int:
        return 0  # scripted events are produced as they are read

    def __aiter__(self) -> AsyncIterator[StepEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[StepEvent]:
        engine, request = self.engine, self.request
        engine.running += 1
        try:
            await engine.gate.wait()
            texts: list[str] = []
            n = request.stopping.max_new_tokens
            for i in range(n):
                if self.cancelled:
                    return
                await asyncio.sleep(engine.token_delay)
                if engine.fail_after is not None and i >= engine.fail_after:
                    raise engine.fail_with
                token = token_id(request, i)
                special = i in engine.special_at
                if special:
                    token = 1
                    info = TokenInfo(id=1, text="<s>", logprob=-3.0, special=True)
                else:
                    texts.append(token_text(token))
                    info = TokenInfo(id=token, text=texts[-1], logprob=token_logprob(token))
                top = tuple(
                    TokenInfo(id=token + k, text=token_text(token + k), logprob=-0.5 * (k + 1))
                    for k in range(request.top_n_tokens)
                )
                prefill = None
                if i == 0 and request.prefill_logprobs:
                    prefill = tuple(
                        TokenInfo(id=t, text=f"p{t}", logprob=math.nan if j == 0 else -1.0)
                        for j, t in enumerate(request.input_ids)
                    )
                finished = None
                if i == n - 1:
                    finished = Finished(
                        generated_text="".join(texts),
                        generated_tokens=n,
                        finish_reason=FinishReason.LENGTH,
                        seed=request.sampling.seed if request.sampling.do_sample else None,
                        queue_seconds=0.001,
                        inference_seconds=0.002,
                    )
                yield StepEvent(token=info, top_tokens=top, prefill=prefill, finished=finished)
        finally:
            engine.running -= 1


@dataclass
class ScriptedEngine:
    """Engine double. `gate` holds every stream before its first token until set; `fail_after`
    makes streams raise `fail_with` after that many tokens; `max_in_flight` refuses more."""

    token_delay: float = 0.0
    fail_after: int | None = None
    fail_with: EngineError = field(default_factory=lambda: EngineError("boom"))
    max_in_flight: int | None = None
    # Positions at which the double emits a special token (text "<s>", special=True) instead.
    special_at: tuple[int, ...] = ()
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    submitted: list[ValidatedRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    running: int = 0
    submit_error: EngineError | None = None
    adapters: list[AdapterInfo] = field(default_factory=list)  # "loaded" LoRA adapters

    def __post_init__(self) -> None:
        self.gate.set()

    def submit(self, request: ValidatedRequest) -> _Stream:
        if self.submit_error is not None:
            raise self.submit_error
        if self.max_in_flight is not None and self.running >= self.max_in_flight:
            raise OverloadedError("engine full")
        self.submitted.append(request)
        return _Stream(self, request)

    def stats(self) -> EngineStats:
        return EngineStats(
            queued=0,
            running=self.running,
            kv_blocks_total=64,
            kv_blocks_free=64 - self.running,
            last_batch_size=self.running,
            steps=len(self.submitted),
            prefill_tokens_computed=sum(len(r.input_ids) for r in self.submitted),
            prefix_cache_hit_tokens=3,
            preemptions=1,
            extra={"step_ms": 1.5},
        )

    def list_adapters(self) -> list[AdapterInfo]:
        return list(self.adapters)

    async def load_adapters(self, sources: list[AdapterSource]) -> list[AdapterInfo]:
        loaded = [AdapterInfo(s.name, s.path, 4, 8.0, ("q_proj",)) for s in sources]
        self.adapters.extend(loaded)
        return loaded

    async def unload_adapter(self, name: str) -> None:
        self.adapters[:] = [a for a in self.adapters if a.name != name]
