"""Per-request state and batching of one shard: turns Prefill/Decode/FilterBatch/ClearCache
(domain form) into flat ragged model steps and per-request Generations.

Requests are keyed by router id; a batch is an ordered list of request ids. The router owns the
KV blocks: a request's block table is whatever the router sent (Prefill) or granted (BlockGrant).

Speculative decoding: a decoding request may come with draft tokens (the router's n-gram
guesses). Its row in the step is a chunk of 1 + k tokens (its last token, then the drafts)
continuing its cached context, and every one of the k + 1 positions is sampled exactly as a
one-token step would sample it (same processors, same seeded generator of (seed, generated
position), the drafts before it in the history). The step emits the sampled tokens up to and
including the first that differs from its draft, so outputs are those of decoding one token per
step, token for token, seeded samples included. For a point-mass draft this is the standard
speculative rejection rule: the draft x is accepted with probability p(x), and on rejection the
emitted token is distributed as p restricted to tokens != x, renormalised. Stopping, logprobs
and top-n tokens see only emitted tokens; afterwards the request's block table is cut to
ceil(computed / block_size) blocks (the router frees the rest the same way).
"""

from __future__ import annotations

import contextlib
import math
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import tokenizers
import torch

from shard.engine.contracts import (
    BatchSpec,
    BlockGrant,
    CachedBatchRef,
    ExpertLoad,
    FinishedText,
    Generation,
    ImageSpec,
    RequestSpec,
    StepResult,
    StepTimings,
    TokenList,
)
from shard.engine.grammar import GrammarEngine, GrammarState, MaskJob, apply_token_bitmask
from shard.engine.sampling import (
    DeviceSample,
    SampleOutput,
    Sampler,
    SamplingParams,
    host_to_device,
    prompt_logprobs,
    read_host,
)
from shard.engine.step_timer import GpuStepTimer
from shard.engine.stopping import StoppingCriteria, StopReason
from shard.errors import (
    FailedPreconditionError,
    FatalDeviceError,
    InvalidRequestError,
    NotFoundError,
)
from shard.lora import LoraManager
from shard.runner.images import StepImage
from shard.runner.model_runner import ModelRunner, StepInputs
from shard.text.detokenizer import IncrementalDetokenizer

# Sampling steps per MoE routing-statistics window (tokenwire_moe_expert_load_ratio): one
# [num_experts] copy rides a step's sampled-token copy every this many steps.
EXPERT_LOAD_WINDOW = 32


@dataclass
class ShardRequest:
    """One request's state on this rank, from its first Prefill chunk until it finishes or the
    router filters it out."""

    id: int
    # Prompt + every generated token (incl. those before a preemption). An int64 array rather
    # than a list: the sampler's penalties read whole histories every step, and an array is
    # handed to torch as one memcpy instead of a per-int conversion.
    token_ids: array
    prompt_len: int
    computed_len: int  # tokens whose K/V are in the cache
    blocks: list[int]
    sampling: SamplingParams
    stopping: StoppingCriteria
    # None for an ids-only request (the router detokenizes it): no text work here at all.
    detok: IncrementalDetokenizer | None
    generated_count: int
    prefill_logprobs: bool
    top_n: int
    prompt_lps: list[float] = field(default_factory=list)  # logprob of prompt token p + 1
    # Generated text without special tokens' text (EOS, BOS): what GeneratedText.text reports.
    visible_text: list[str] = field(default_factory=list)
    # Leading entries of `blocks` already checked against the KV pool (block tables only grow
    # between Prefill chunks, so each id is range-checked once, not on every step).
    blocks_checked: int = 0
    adapter: str = ""  # LoRA adapter name; "" for the base model
    grammar: GrammarState | None = None  # the request's matcher when it is constrained
    # M-RoPE models (Qwen2-VL) with images in the prompt: [3, len(token_ids) at admission]
    # positions of the known tokens; later tokens sit at index + rope_delta on all three rows.
    mrope: np.ndarray | None = None
    rope_delta: int = 0
    # The launched, unfinished step that samples this request's next token (overlap): the
    # token is on the device only, at row `pending_row` of that step's sampled ids.
    pending: LaunchedStep | None = None
    pending_row: int = 0

    @property
    def known_len(self) -> int:
        """Tokens known so far, the one still on the device included."""
        return len(self.token_ids) + (self.pending is not None)


@dataclass
class _Work:
    """One sequence of a step: compute token_ids[start:start + length] (with drafts: the last
    token, then the drafts; length = 1 + len(drafts))."""

    state: ShardRequest
    start: int
    length: int
    samples: bool  # the step ends at the sequence's last known token: sample the next one
    drafts: list[int] | tuple[()] = ()  # draft tokens to verify (speculative decoding)
    images: tuple[ImageSpec, ...] = ()  # images overlapping [start, start + length)


def _has_chunks(work: list[_Work]) -> bool:
    """Whether a step computes more than one token for some sequence (a prompt chunk; drafts
    too, which never overlap anyway): its forward runs eagerly."""
    return any(w.length > 1 for w in work)


@dataclass
class LaunchedStep:
    """A step whose device work is queued (launch_prefill / launch_decode) and whose outputs
    are not read yet: `finish` turns it into its StepResult. While it runs on the device, the
    next step may be launched with this step's sampled ids as its input placeholders."""

    work: list[_Work]  # the sampling sequences, in row order
    batch_id: int
    merged: list[int]
    timings: StepTimings
    sampled: DeviceSample | None = None  # None: nothing sampled (no sampling rows)
    host: torch.Tensor | None = None  # sampled.packed's host copy (pinned on CUDA)
    done: torch.cuda.Event | None = None  # the copy into `host` has completed
    drafts: bool = False  # rows with drafts: a request emits an unknown number of tokens
    result: StepResult | None = None
    # MoE routing counts [num_experts] of the window this step closes: on the device, then
    # copied with the sampled results (pinned host on CUDA); the window's step count
    expert_counts: torch.Tensor | None = None
    expert_steps: int = 0
    # Called on the model worker once `result` is set (the servicer hands it to the waiting RPC
    # without a second trip through the worker, which may be busy launching the next step).
    on_result: Callable[[], None] | None = None

    def wait_device(self) -> None:
        """Blocks until this step's results are on the host (no Python state is touched:
        callable from any thread). A device failure is left for `finish` to report."""
        if self.done is not None:
            with contextlib.suppress(Exception):  # finish raises it as a FatalDeviceError
                self.done.synchronize()


class BatchState:
    """The requests and batches of one rank, keyed by router ids; each call (prefill, decode,
    filter_batch, clear_cache) runs on the single model worker thread.

    Overlap: `launch_prefill` / `launch_decode` queue a step's device work and return at once;
    `finish` reads its sampled tokens (one asynchronous device-to-host copy per step, on a side
    stream) and does the host work (detokenization, stopping, Generations). A step launched
    while the previous one is unfinished takes that step's sampled ids as its input tokens on
    the device (placeholders), so the host prepares and launches step N+1 while the device
    computes step N, then finishes step N while the device computes step N+1. Steps whose rows
    need the previous token on the host (penalties, watermark, grammar masks, drafts, LoRA
    slots, prompt logprobs) first finish the previous step (no overlap for them). A request
    that finishes at step N is still computed at step N+1 (one wasted row) and dropped there.
    `prefill` / `decode` are launch + finish: the steps of the synchronous protocol.
"""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: tokenizers.Tokenizer,
        eos_token_ids: set[int],
        max_position_embeddings: int,
        lora: LoraManager | None = None,
        expert_load_window: int = EXPERT_LOAD_WINDOW,
    ):
        self.runner = runner
        # MoE models: every `expert_load_window` sampling steps, the routing counts ride the
        # step's device-to-host copy into its StepResult (0: never read).
        self.expert_load_window = expert_load_window
        self._expert_steps = 0
        self.lora = lora  # the rank's LoRA adapters (--max-loras > 0)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_positions = max_position_embeddings
        self.sampler = Sampler(runner.device)
        self.grammars = GrammarEngine(
            tokenizer, runner.model.vocab_size, eos_token_ids,
            pin_memory=runner.device.type == "cuda",
        )
        self.requests: dict[int, ShardRequest] = {}
        self.batches: dict[int, list[int]] = {}
        # Launched, unfinished steps, oldest first (at most two with the overlapping protocol).
        self._inflight: deque[LaunchedStep] = deque()
        # Batch ids merged away by a launch while an earlier step that names them was running.
        self._retired: set[int] = set()
        # Requests finished by a step finished since the last launch: the router may name them
        # in the next step before it has read that step's answer (overlap); they are skipped.
        self._finished_unseen: set[int] = set()
        self.overlapped_steps = 0  # steps launched while the previous one was unfinished
        self.overlapped_chunk_steps = 0  # ... of them, steps with prompt chunks
        # Whether a step with prompt chunks (an eager forward) may launch while the previous
        # step runs. On CUDA it does not: its launch is host-bound (hundreds of kernel launches
        # take about as long as the GPU runs them), so overlapping gains nothing, while the
        # previous step's results would wait on the single model worker until the whole launch
        # is done, reaching clients a step late (their inter-token gaps doubled; issue 44).
        # Elsewhere (CPU, tests of the overlapped eager path) it may.
        self.overlap_eager_steps = runner.device.type != "cuda"
        # Device time of each step's forward + sampling (benchmarks; None: not measured).
        self.gpu_timer: GpuStepTimer | None = None
        self._copy_stream = (
            torch.cuda.Stream(runner.device) if runner.device.type == "cuda" else None
        )
        special = tokenizer.get_added_tokens_decoder()
        self._special = {i for i, tok in special.items() if tok.special}

    # ---- state management -------------------------------------------------------------------

    def _new_state(self, spec: RequestSpec) -> ShardRequest:
        if spec.generated_len > len(spec.input_ids):
            raise InvalidRequestError(f"request {spec.id}: generated_len exceeds input_ids")
        prompt_len = len(spec.input_ids) - spec.generated_len
        detok = None
        visible_text = []
        if not spec.ids_only:
            detok = IncrementalDetokenizer(self.tokenizer, list(spec.input_ids[:prompt_len]))
            for token in spec.input_ids[prompt_len:]:  # replay generations before a preemption
                text = detok.push(token)
                if token not in self._special:
                    visible_text.append(text)
        return ShardRequest(
            id=spec.id,
            token_ids=array("q", spec.input_ids),
            prompt_len=prompt_len,
            computed_len=spec.cache_len,
            blocks=list(spec.blocks),
            sampling=spec.sampling,
            stopping=StoppingCriteria(
                self.eos_token_ids,
                spec.max_new_tokens,
                [] if spec.ids_only else spec.stop_sequences,  # the router matches them
                spec.ignore_eos_token,
            ),
            detok=detok,
            generated_count=spec.generated_len,
            prefill_logprobs=spec.prefill_logprobs,
            top_n=spec.top_n_tokens,
            visible_text=visible_text,
            adapter=spec.adapter_id,
            grammar=(
                self.grammars.new_state(spec.grammar, list(spec.input_ids[prompt_len:]))
                if spec.grammar is not None
                else None
            ),
        )

    def _forget(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    def _request(self, rid: int) -> ShardRequest:
        state = self.requests.get(rid)
        if state is None:
            raise InvalidRequestError(f"unknown request id {rid}")
        return state

    def _apply_grants(self, grants: list[BlockGrant], unseen: set[int] = frozenset()) -> None:
        for grant in grants:
            state = self._known(grant.request_id, unseen)
            if state is not None:
                state.blocks.extend(grant.blocks)

    def _check_blocks(self, rid: int, blocks: list[int], seq_len: int) -> None:
        bs = self.runner.block_size
        if len(blocks) * bs < seq_len:
            raise InvalidRequestError(
                f"request {rid}: {len(blocks)} blocks hold {len(blocks) * bs} "
                f"tokens but the step needs {seq_len}; grant more blocks"
            )
        if any(b >= self.runner.num_blocks for b in blocks[: math.ceil(seq_len / bs)]):
            self._block_out_of_range(rid)
        if seq_len > self.max_positions:
            self._too_long(rid, seq_len)

    def _check_state_blocks(self, state: ShardRequest, seq_len: int) -> None:
        """_check_blocks for a known request: only block ids not yet checked are range-checked
        (a decode step usually checks none)."""
        bs = self.runner.block_size
        blocks = state.blocks
        if len(blocks) * bs < seq_len:
            self._check_blocks(state.id, blocks, seq_len)  # raises
        if seq_len > self.max_positions:
            self._too_long(state.id, seq_len)
        need = -(-seq_len // bs)
        if need > state.blocks_checked:
            limit = self.runner.num_blocks
            if any(b >= limit for b in blocks[state.blocks_checked : need]):
                self._block_out_of_range(state.id)
            state.blocks_checked = need

    def _block_out_of_range(self, rid: int) -> None:
        raise InvalidRequestError(
            f"request {rid}: block id out of range (num_blocks={self.runner.num_blocks})"
        )

    def _too_long(self, rid: int, seq_len: int) -> None:
        raise InvalidRequestError(
            f"request {rid}: {seq_len} tokens exceed max_position_embeddings "
            f"{self.max_positions}"
        )

    # ---- RPCs -------------------------------------------------------------------------------

    def _decode_work(self, state: ShardRequest, drafts: dict[int, list[int]] | None) -> _Work:
        """The row of a decoding request: its last token, plus its drafts when it has some."""
        d = drafts.get(state.id) if drafts else None
        if not d:
            return _Work(state, state.computed_len, 1, True)
        vocab = self.runner.model.vocab_size
        if any(t >= vocab for t in d):
            raise InvalidRequestError(
                f"request {state.id}: draft token id out of range (vocab_size={vocab})"
            )
        return _Work(state, state.computed_len, 1 + len(d), True, d)

    def _check_drafts(self, drafts: dict[int, list[int]] | None, work: list[_Work]) -> None:
        if drafts and len(drafts) != sum(1 for w in work if w.drafts):
            raise InvalidRequestError(
                "drafts name requests that do not decode in this step: "
                f"{sorted(set(drafts) - {w.state.id for w in work if w.drafts})}"
            )

    def prefill(
        self,
        batch: BatchSpec,
        cached: CachedBatchRef | None,
        grants: list[BlockGrant],
        drafts: dict[int, list[int]] | None = None,
    ) -> StepResult:
        return self.finish(self.launch_prefill(batch, cached, grants, drafts))

    def decode(
        self,
        batches: list[CachedBatchRef],
        grants: list[BlockGrant],
        drafts: dict[int, list[int]] | None = None,
    ) -> StepResult:
        return self.finish(self.launch_decode(batches, grants, drafts))

    def _take_unseen(self, overlap: bool) -> set[int]:
        """Ids this step may name although they finished (overlap only)."""
        unseen, self._finished_unseen = self._finished_unseen, set()
        return unseen if overlap else set()

    def _known(self, rid: int, unseen: set[int]) -> ShardRequest | None:
        """A request the router names in a step; None when it finished at a step whose answer
        the router had not read when it sent this one (overlap)."""
        state = self.requests.get(rid)
        if state is None and rid not in unseen:
            raise InvalidRequestError(f"unknown request id {rid}")
        return state

    def launch_prefill(
        self,
        batch: BatchSpec,
        cached: CachedBatchRef | None,
        grants: list[BlockGrant],
        drafts: dict[int, list[int]] | None = None,
        overlap: bool = False,
    ) -> LaunchedStep:
        """Queues a Prefill step (finish reads it). overlap: the router sends steps before it
        has read the answers of the earlier ones, so this step may run while the previous one
        is unfinished and may name requests that finished there (they are skipped)."""
        t0 = time.perf_counter_ns()
        if self.runner.kv_cache is None:
            raise FailedPreconditionError("Warmup must run before Prefill")
        # M-RoPE positions of new requests' prompts ([3, len], delta), computed while validating
        rope: dict[int, tuple[np.ndarray, int]] = {}
        for spec in batch.requests:  # validate everything before any state changes
            end = spec.cache_len + spec.chunk_len
            if spec.chunk_len == 0 or end > len(spec.input_ids):
                raise InvalidRequestError(
                    f"request {spec.id}: cache_len + chunk_len must be in (cache_len, "
                    f"len(input_ids)={len(spec.input_ids)}]; got {spec.cache_len} + {spec.chunk_len}"
                )
            self._check_blocks(spec.id, spec.blocks, end)
            if spec.adapter_id and (self.lora is None or not self.lora.has(spec.adapter_id)):
                raise InvalidRequestError(
                    f"request {spec.id}: adapter '{spec.adapter_id}' is not loaded on this shard"
                )
            if spec.grammar is not None and (spec.cache_len == 0 or spec.id not in self.requests):
                self.grammars.check(spec.grammar)  # compiled (and cached) before any change
            if spec.images:
                self._check_images(spec)
                if (getattr(self.runner.model, "mrope", False)
                        and (spec.cache_len == 0 or spec.id not in self.requests)):
                    rope[spec.id] = self._rope_positions(spec)
        work: list[_Work] = []
        new_ids: list[int] = []
        for spec in batch.requests:
            end = spec.cache_len + spec.chunk_len
            state = self.requests.get(spec.id)
            if state is None or spec.cache_len == 0:
                state = self._new_state(spec)
                self.requests[spec.id] = state
                if spec.id in rope:
                    state.mrope, state.rope_delta = rope[spec.id]
            else:  # next chunk: the router replaces block table and cursor
                state.blocks = list(spec.blocks)
                state.blocks_checked = 0
                state.computed_len = spec.cache_len
            work.append(_Work(state, spec.cache_len, spec.chunk_len, end == len(state.token_ids),
                              images=spec.images))
            new_ids.append(spec.id)
        unseen = self._take_unseen(overlap)
        self._apply_grants(grants, unseen)
        chunked = set(new_ids)
        cached_ids = list(cached.request_ids) if cached else []
        for rid in cached_ids:
            if rid in chunked:
                continue
            state = self._known(rid, unseen)
            if state is None or state.computed_len != state.known_len - 1:
                continue  # still prefilling and no chunk this step: it waits
            work.append(self._decode_work(state, drafts))
        self._check_drafts(drafts, work)
        merged = cached_ids + [rid for rid in new_ids if rid not in set(cached_ids)]
        if cached and cached.id != batch.id:
            self._retire(cached.id)
        return self._launch(work, t0, batch.id, merged, overlap)

    def launch_decode(
        self,
        batches: list[CachedBatchRef],
        grants: list[BlockGrant],
        drafts: dict[int, list[int]] | None = None,
        overlap: bool = False,
    ) -> LaunchedStep:
        """Queues a Decode step (finish reads it); overlap as in launch_prefill."""
        t0 = time.perf_counter_ns()
        if not batches:
            raise InvalidRequestError("Decode needs at least one batch")
        unseen = self._take_unseen(overlap)
        self._apply_grants(grants, unseen)
        merged: list[int] = []
        work: list[_Work] = []
        for ref in batches:
            for rid in ref.request_ids:
                state = self._known(rid, unseen)
                if state is None:
                    continue
                merged.append(rid)
                if state.computed_len == state.known_len - 1:
                    work.append(self._decode_work(state, drafts))
                # else: still prefilling (its next chunk comes with a Prefill); it waits
        self._check_drafts(drafts, work)
        for ref in batches[1:]:
            self._retire(ref.id)
        return self._launch(work, t0, batches[0].id, merged, overlap)

    def _retire(self, batch_id: int) -> None:
        """Forgets a batch merged into another; a running step that names it will not bring
        it back when it finishes."""
        self.batches.pop(batch_id, None)
        if self._inflight:
            self._retired.add(batch_id)

    def filter_batch(self, batch_id: int, keep: list[int]) -> CachedBatchRef:
        self.settle()
        if batch_id not in self.batches:
            raise NotFoundError(f"unknown batch id {batch_id}")
        keep_set = set(keep)
        current = self.batches[batch_id]
        self._forget([rid for rid in current if rid not in keep_set])
        kept = [rid for rid in current if rid in keep_set]
        if kept:
            self.batches[batch_id] = kept
        else:  # an empty batch is forgotten, as after a step that finishes everything
            del self.batches[batch_id]
        return CachedBatchRef(batch_id, kept)

    def clear_cache(self, batch_id: int | None) -> None:
        self.settle()
        if batch_id is None:
            self.requests.clear()
            self.batches.clear()
            self._retired.clear()
            self._finished_unseen.clear()
            return
        self._forget(self.batches.pop(batch_id, []))

    # ---- one step -----------------------------------------------------------------------------

    def _finish_step(
        self, batch_id: int, merged: list[int], generations: list[Generation],
        timings: StepTimings,
    ) -> StepResult:  # fmt: skip
        alive = [rid for rid in merged if rid in self.requests]
        if batch_id in self._retired:  # merged into a later step's batch meanwhile
            self._retired.discard(batch_id)
            ref = CachedBatchRef(batch_id, alive) if alive else None
        elif alive:
            self.batches[batch_id] = alive
            ref = CachedBatchRef(batch_id, alive)
        else:
            self.batches.pop(batch_id, None)
            ref = None
        return StepResult(generations, ref, timings)

    # ---- launching and finishing steps ----------------------------------------------------------

    def _launch(
        self, work: list[_Work], t0: int, batch_id: int, merged: list[int], overlap: bool
    ) -> LaunchedStep:
        """Queues the step's device work; the step before it may still run (overlap)."""
        while len(self._inflight) > 1:
            self._finish_one()
        prev = self._inflight[-1] if self._inflight else None
        if prev is not None and not (overlap and self._can_overlap(prev, work)):
            self.settle()
            prev = None
            # A request that finished at the step just finished is not computed.
            work = [w for w in work if self.requests.get(w.state.id) is w.state]
        step = LaunchedStep(work=[], batch_id=batch_id, merged=merged, timings=StepTimings())
        if prev is not None:
            self.overlapped_steps += 1
            if _has_chunks(work):
                self.overlapped_chunk_steps += 1
        self._run_step(step, work, t0, prev)
        self._inflight.append(step)
        return step

    def _can_overlap(self, prev: LaunchedStep, work: list[_Work]) -> bool:
        """Whether the step can run with `prev` unfinished: no row needs a token that is still
        on the device on the host (penalties, watermark, grammar masks), and no row uses what
        the overlapped path does not cover (drafts, LoRA slots, prompt logprobs)."""
        if prev.drafts:
            return False
        if not self.overlap_eager_steps and _has_chunks(work):
            return False
        for w in work:
            st = w.state
            if w.drafts or st.grammar is not None or st.adapter or st.prefill_logprobs:
                return False
            if st.pending is prev:
                p = st.sampling
                if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.watermark:
                    return False
        return True

    def settle(self) -> None:
        """Finishes every launched step (their results wait for their `finish` calls)."""
        while self._inflight:
            self._finish_one()

    def finish(self, step: LaunchedStep) -> StepResult:
        """The step's outputs (finishing the steps launched before it first)."""
        while step.result is None:
            self._finish_one()
        return step.result

    def _finish_one(self) -> None:
        step = self._inflight[0]
        t2 = time.perf_counter_ns()
        work = step.work
        for w in work:
            if w.state.pending is step:
                w.state.pending = None
        generations: list[Generation] = []
        try:
            if step.sampled is not None:
                try:
                    if step.done is not None:
                        step.done.synchronize()
                    out = read_host(step.sampled, step.host)
                except Exception as exc:
                    raise FatalDeviceError(
                        f"forward pass failed: {type(exc).__name__}: {exc}"
                    ) from exc
                generations = self._emit(work, out)
        finally:
            self._inflight.popleft()
        t3 = time.perf_counter_ns()
        timings = step.timings
        timings.decode_ns = t3 - t2
        timings.total_ns += t3 - t2
        step.result = self._finish_step(step.batch_id, step.merged, generations, timings)
        if step.expert_counts is not None:  # on the host now (the copy above completed)
            step.result.expert_load = ExpertLoad(step.expert_counts.tolist(), step.expert_steps)
        if step.on_result is not None:
            step.on_result()

    def _decode_inputs(
        self, work: list[_Work], prev: LaunchedStep | None
    ) -> tuple[StepInputs, list[int], list[int]]:
        """StepInputs of a step whose sequences all compute one token and sample (the usual
        decode step): built with one comprehension per field instead of per-row appends. A
        one-token step never reaches a prompt-logprob row (its start is >= prompt_len - 1).
        Also the placeholder rows: (flat rows, rows of prev's sampled ids)."""
        for w in work:
            self._check_state_blocks(w.state, w.start + 1)
        starts = [w.start for w in work]
        n = len(work)
        # M-RoPE requests decode at index + delta (the same on all three rows)
        positions = [w.start + w.state.rope_delta for w in work]
        dst: list[int] = []
        src: list[int] = []
        if prev is None:
            token_ids = [w.state.token_ids[w.start] for w in work]
        else:
            token_ids = []
            for i, w in enumerate(work):
                st = w.state
                if st.pending is prev:
                    token_ids.append(0)  # on the device: prev's sampled ids, row pending_row
                    dst.append(i)
                    src.append(st.pending_row)
                else:
                    token_ids.append(st.token_ids[w.start])
        inputs = StepInputs(
            token_ids=token_ids,
            positions=positions,
            query_lens=[1] * n,
            seq_lens=[s + 1 for s in starts],
            block_tables=[w.state.blocks for w in work],
            logits_indices=list(range(n)),
            lora_slots=self._lora_slots(work),
        )
        return inputs, dst, src

    def _check_images(self, spec: RequestSpec) -> None:
        """Images only for a vision-language model, inside the prompt, pixels as shaped, as
        many placeholders as the encoder yields rows. Pixels only for the images the chunk
        covers (the others come for their place in the prompt: M-RoPE positions)."""
        if not self.runner.model.supports_images:
            raise InvalidRequestError(
                f"request {spec.id}: images were sent, but this model takes no images"
            )
        for i, image in enumerate(spec.images):
            elems = math.prod(image.shape) if image.shape else 0
            if image.length == 0 or image.offset + image.length > len(spec.input_ids):
                raise InvalidRequestError(
                    f"request {spec.id}: images[{i}] spans [{image.offset}, "
                    f"{image.offset + image.length}), outside len(input_ids)="
                    f"{len(spec.input_ids)}"
                )
            used = (image.offset < spec.cache_len + spec.chunk_len
                    and spec.cache_len < image.offset + image.length)
            if elems == 0 or (used and len(image.pixel_values) != 4 * elems):
                raise InvalidRequestError(
                    f"request {spec.id}: images[{i}].pixel_values has "
                    f"{len(image.pixel_values)} bytes; shape {list(image.shape)} needs "
                    f"{4 * elems} (float32)"
                )
            rows = self.runner.image_token_count(image.shape)
            if rows is None or rows != image.length:
                raise InvalidRequestError(
                    f"request {spec.id}: images[{i}] of shape {list(image.shape)} has "
                    f"{image.length} placeholder tokens; the model's encoder takes "
                    + ("no such shape" if rows is None else f"{rows} for it")
                )

    def _rope_positions(self, spec: RequestSpec) -> tuple[np.ndarray, int]:
        """A new request's M-RoPE positions (model.rope_positions: transformers' get_rope_index
        over the whole prompt; every image of the prompt comes with each chunk). Its images
        must be in order with a token between each two (transformers groups adjacent image
        tokens into one image)."""
        end = -1
        for i, image in enumerate(spec.images):
            if image.offset <= end:
                raise InvalidRequestError(
                    f"request {spec.id}: images[{i}] starts at {image.offset}; images must be in "
                    f"prompt order with at least one token between them (the previous ends at "
                    f"{end})"
                )
            end = image.offset + image.length
        return self.runner.model.rope_positions(  # type: ignore[attr-defined]
            list(spec.input_ids), [(i.offset, i.length, i.shape) for i in spec.images])

    def _lora_slots(self, work: list[_Work]) -> list[int] | None:
        """Each sequence's device slot of its adapter (-1: none), swapping adapters in; None
        when no sequence of the step has one."""
        if self.lora is None or not any(w.state.adapter for w in work):
            return None
        return self.lora.slots_for([w.state.adapter for w in work], self.adapters_in_use)

    def adapters_in_use(self) -> set[str]:
        """Adapters of the requests this rank holds (never evicted from their slots)."""
        return {r.adapter for r in self.requests.values() if r.adapter}

    def _step_inputs(
        self, work: list[_Work], prev: LaunchedStep | None
    ) -> tuple[StepInputs, int, list[int], list[int], list[ShardRequest], list[int], list[int]]:
        """The flat ragged inputs of a general step: inputs, number of sampled rows, the
        prompt-logprob rows (rows, next ids, owners) and the placeholder rows (flat rows, rows
        of prev's sampled ids)."""
        inputs = StepInputs([], [], [], [], [], [])
        sample_rows: list[int] = []
        lp_rows: list[int] = []  # rows whose logits give a prompt token's logprob
        lp_next: list[int] = []
        lp_owner: list[ShardRequest] = []
        dst: list[int] = []
        src: list[int] = []
        rows3: list[tuple[int, np.ndarray]] = []  # (flat row, [3, n] M-RoPE positions)
        for w in work:
            seq_len = w.start + w.length
            self._check_state_blocks(w.state, seq_len)
            base = len(inputs.token_ids)
            if w.drafts:  # the last token, then the drafts
                inputs.token_ids.append(w.state.token_ids[w.start])
                inputs.token_ids.extend(w.drafts)
            elif prev is not None and w.state.pending is prev:  # one token, on the device
                inputs.token_ids.append(0)
                dst.append(base)
                src.append(w.state.pending_row)
            else:
                inputs.token_ids.extend(w.state.token_ids[w.start : seq_len])
            if w.state.mrope is not None and w.start < w.state.mrope.shape[1]:
                rows3.append((base, _mrope_rows(w.state, w.start, seq_len)))
            inputs.positions.extend(range(w.start + w.state.rope_delta,
                                          seq_len + w.state.rope_delta))
            inputs.query_lens.append(w.length)
            inputs.seq_lens.append(seq_len)
            inputs.block_tables.append(w.state.blocks)
            if w.state.prefill_logprobs:
                for p in range(w.start, min(seq_len, w.state.prompt_len - 1)):
                    lp_rows.append(base + p - w.start)
                    lp_next.append(w.state.token_ids[p + 1])
                    lp_owner.append(w.state)
            for image in w.images:  # the image rows this chunk covers
                lo, hi = max(w.start, image.offset), min(seq_len, image.offset + image.length)
                if lo < hi:
                    inputs.images.append(StepImage(image.content_hash, image.shape,
                                                   image.pixel_values, base + lo - w.start,
                                                   lo - image.offset, hi - lo))
            if w.drafts:  # every position samples: the last token's and each draft's
                sample_rows.extend(range(base, base + w.length))
            elif w.samples:
                sample_rows.append(base + w.length - 1)
        inputs.logits_indices = sample_rows + lp_rows
        inputs.lora_slots = self._lora_slots(work)
        if rows3:  # prompt rows with 3-D positions: every row gets three ([3, num_tokens])
            pos3 = np.tile(np.asarray(inputs.positions, dtype=np.int64), (3, 1))
            for base, rows in rows3:
                pos3[:, base : base + rows.shape[1]] = rows
            inputs.rope_positions = pos3
        return inputs, len(sample_rows), lp_rows, lp_next, lp_owner, dst, src

    def _run_step(
        self, step: LaunchedStep, work: list[_Work], t0: int, prev: LaunchedStep | None
    ) -> None:
        """Builds the step's inputs and queues its forward pass and sampling on the device,
        then the one device-to-host copy of the sampled results (on the copy stream)."""
        if not work:
            step.timings.total_ns = time.perf_counter_ns() - t0
            return
        lp_rows: list[int] = []
        lp_next: list[int] = []
        lp_owner: list[ShardRequest] = []
        if all(w.length == 1 and w.samples and not w.images for w in work):
            inputs, dst, src = self._decode_inputs(work, prev)
            num_samples = len(work)
        else:
            inputs, num_samples, lp_rows, lp_next, lp_owner, dst, src = self._step_inputs(
                work, prev
            )
        timings = step.timings
        t1 = time.perf_counter_ns()
        timings.prepare_ns = t1 - t0
        sampling = [w for w in work if w.samples]
        device = self.runner.device
        placeholders = None
        if dst:
            assert prev is not None and prev.sampled is not None
            # Pinned sources: a copy from pageable memory may wait for the running step.
            rows = host_to_device(torch.tensor(src, dtype=torch.long), device)
            placeholders = (
                host_to_device(torch.tensor(dst, dtype=torch.long), device),
                prev.sampled.next_ids.index_select(0, rows),
            )
        timer = self.gpu_timer
        if timer is not None:
            timer.begin()
        # The bitmask of the constrained rows is filled on the mask thread while the forward runs.
        masks = self._start_masks(sampling)
        try:
            logits = (  # [num_logits, vocab]
                self.runner.execute(inputs)
                if placeholders is None
                else self.runner.execute(inputs, placeholders)
            )
        except Exception as exc:  # the KV cache may be half-written: the shard cannot go on
            if masks is not None:
                masks.join()  # never leave the fill running past a dead step
            raise FatalDeviceError(f"forward pass failed: {type(exc).__name__}: {exc}") from exc
        if masks is not None:
            # [num_samples, vocab]: disallowed tokens -> -inf on the device, before sampling
            apply_token_bitmask(logits[:num_samples], masks.wait(logits.device))
        for w in work:  # rows with drafts advance by what they emit (_emit_verified)
            w.state.computed_len = w.start + w.length
        if lp_rows:  # (a blocking copy: steps with prompt logprobs never overlap)
            values = prompt_logprobs(
                logits[num_samples:], torch.tensor(lp_next, device=logits.device)
            )
            for state, value in zip(lp_owner, values):
                state.prompt_lps.append(value)
        if sampling:
            step.sampled = self._sample_device(sampling, logits[:num_samples])
            step.work = sampling
            step.drafts = any(w.drafts for w in sampling)
            row = 0
            for w in sampling:
                w.state.pending = step
                w.state.pending_row = row
                row += 1 + len(w.drafts)
        if timer is not None:
            timer.end()
        if step.sampled is not None:
            self._close_expert_window(step)
            self._copy_to_host(step)
        t2 = time.perf_counter_ns()
        timings.forward_ns = t2 - t1
        timings.total_ns = t2 - t0

    def _close_expert_window(self, step: LaunchedStep) -> None:
        """Counts the step into the MoE routing window; the step that closes it takes the
        counts (a device snapshot, read with the step's sampled results: no extra sync)."""
        if not self.expert_load_window:
            return
        self._expert_steps += 1
        if self._expert_steps < self.expert_load_window:
            return
        counts = self.runner.model.take_expert_counts()  # [num_experts] int64 or None (dense)
        if counts is not None:
            step.expert_counts, step.expert_steps = counts, self._expert_steps
        self._expert_steps = 0

    def _copy_to_host(self, step: LaunchedStep) -> None:
        """The step's one device-to-host copy: on a side stream into pinned memory, after the
        sampling kernels (with the MoE routing counts of a window the step closes); `step.done`
        marks its end. On the CPU the results are already there."""
        assert step.sampled is not None
        packed = step.sampled.packed
        stream = self._copy_stream
        if stream is None:
            step.host = packed
            return
        counts = step.expert_counts
        if counts is not None:
            pinned = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        ready = torch.cuda.Event()
        ready.record()
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            host.copy_(packed, non_blocking=True)
            if counts is not None:
                pinned.copy_(counts, non_blocking=True)
                counts.record_stream(stream)
                step.expert_counts = pinned
            done = torch.cuda.Event()
            done.record(stream)
        packed.record_stream(stream)  # its memory is not reused before the copy has run
        step.host = host
        step.done = done

    def _start_masks(self, sampling: list[_Work]) -> MaskJob | None:
        """Starts the bitmask fill of the step's sampled logits rows: 1 + len(drafts) per work
        item, in order. Constrained requests carry no drafts (the router never drafts for them:
        each draft position would need its own mask)."""
        rows: list[tuple[int, GrammarState]] = []
        at = 0
        for w in sampling:
            if w.state.grammar is not None:
                if w.drafts:
                    raise InvalidRequestError(
                        f"request {w.state.id}: draft tokens for a grammar-constrained request"
                    )
                rows.append((at, w.state.grammar))
            at += 1 + len(w.drafts)
        if not rows:
            return None
        return self.grammars.start(rows, at)

    def _sample_device(self, work: list[_Work], logits: torch.Tensor) -> DeviceSample:
        """logits [rows, vocab]: one row per sampling sequence, 1 + len(drafts) for one with
        drafts (its positions in order). A token still on the device (overlap) counts as
        generated: it is the seeded position's predecessor."""
        if any(w.drafts for w in work):
            params: list[SamplingParams] = []
            histories: list[array] = []
            counts: list[int] = []
            top_n: list[int] = []
            for w in work:
                s = w.state
                params.append(s.sampling)
                histories.append(s.token_ids)
                counts.append(s.generated_count)
                top_n.append(s.top_n)
                for j in range(1, len(w.drafts) + 1):
                    # Position j samples after drafts[:j], as a one-token step would after them.
                    params.append(s.sampling)
                    histories.append(s.token_ids + array("q", w.drafts[:j]))
                    counts.append(s.generated_count + j)
                    top_n.append(s.top_n)
        else:  # the usual step: one row per sequence
            states = [w.state for w in work]
            params = [s.sampling for s in states]
            histories = [s.token_ids for s in states]
            counts = [s.generated_count + (s.pending is not None) for s in states]
            top_n = [s.top_n for s in states]
        return self.sampler.sample_device(logits, params, histories, counts, top_n)

    def _emit(self, work: list[_Work], out: SampleOutput) -> list[Generation]:
        """Generations of a finished step's sampled rows; a request that finished at an earlier
        step (computed once more by an overlapped step) is skipped."""
        generations = []
        row = 0
        requests = self.requests
        for w in work:
            state = w.state
            if requests.get(state.id) is not state:
                row += 1 + len(w.drafts)
                continue
            if w.drafts:
                generations.append(self._emit_verified(w, out, row))
                row += w.length
                continue
            token = out.token_ids[row]
            # The first sampled token completes the prompt: emit its logprobs once.
            prefill_tokens = self._prefill_tokens(state) if state.prefill_logprobs else None
            text, is_special, finished = self._accept(state, token)
            top = [self._top(out, row, state)] if state.top_n else []
            generations.append(
                Generation(
                    request_id=state.id,
                    tokens=TokenList([token], [out.logprobs[row]], [text], [is_special]),
                    prefill_tokens=prefill_tokens,
                    top_tokens=top,
                    finished=finished,
                )
            )
            row += 1
        return generations

    def _accept(self, state: ShardRequest, token: int) -> tuple[str, bool, FinishedText | None]:
        """Appends a generated token: its text, whether it is special, and the finish when it
        ends the request (the request is then forgotten)."""
        state.token_ids.append(token)
        state.generated_count += 1
        detok = state.detok
        is_special = token in self._special
        if detok is None:  # ids only: the router detokenizes and matches stop sequences
            text = ""
            so_far = ""
        else:
            text = detok.push(token)
            if not is_special:
                state.visible_text.append(text)
            # Only stop sequences read the text: joining it every step is O(length) per row.
            so_far = detok.text if state.stopping.stop_sequences else ""
        reason = state.stopping.check(token, so_far, state.generated_count)
        if state.grammar is not None:
            state.grammar.pending.append(token)  # consumed by the next step's mask job
            if reason is None and token in self.eos_token_ids:
                reason = StopReason.EOS_TOKEN  # a finished grammar allows nothing after EOS
        finished = None
        if reason is not None:
            if detok is not None:
                held_back = detok.flush()
                text += held_back
                state.visible_text.append(held_back)
            finished = FinishedText(
                text="".join(state.visible_text),
                generated_tokens=state.generated_count,
                finish_reason=reason,
                seed=state.sampling.seed if state.sampling.do_sample else None,
            )
            del self.requests[state.id]
            self._finished_unseen.add(state.id)
        return text, is_special, finished

    def _top(self, out: SampleOutput, row: int, state: ShardRequest) -> TokenList:
        special = self._special
        ids = list(out.top_ids[row])
        return TokenList(
            ids=ids,
            logprobs=list(out.top_logprobs[row]),
            texts=[""] * len(ids) if state.detok is None else [self._text(t) for t in ids],
            is_special=[t in special for t in ids],
        )

    def _emit_verified(self, w: _Work, out: SampleOutput, row: int) -> Generation:
        """Emits a drafted row's samples up to and including the first that differs from its
        draft (or ends the request); cuts the block table to the computed tokens."""
        state, drafts = w.state, w.drafts
        tokens = TokenList()
        tops: list[TokenList] = []
        finished = None
        for j in range(len(drafts) + 1):
            token = out.token_ids[row + j]
            text, is_special, finished = self._accept(state, token)
            tokens.ids.append(token)
            tokens.logprobs.append(out.logprobs[row + j])
            tokens.texts.append(text)
            tokens.is_special.append(is_special)
            if state.top_n:
                tops.append(self._top(out, row + j, state))
            if finished is not None or j == len(drafts) or token != drafts[j]:
                break
        # K/V of the last token and of the accepted drafts are valid; the rest is overwritten
        # later. Blocks past the computed tokens hold only rejected K/V: the router frees them.
        state.computed_len = w.start + len(tokens.ids)
        keep = -(-state.computed_len // self.runner.block_size)
        del state.blocks[keep:]
        state.blocks_checked = min(state.blocks_checked, keep)
        return Generation(request_id=state.id, tokens=tokens, top_tokens=tops, finished=finished)

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _prefill_tokens(self, state: ShardRequest) -> TokenList:
        ids = state.token_ids[: state.prompt_len]
        state.prefill_logprobs = False  # emitted once
        return TokenList(
            ids=list(ids),
            logprobs=[math.nan] + state.prompt_lps[: len(ids) - 1],
            texts=[""] * len(ids) if state.detok is None else [self._text(t) for t in ids],
            is_special=[t in self._special for t in ids],
        )


def _mrope_rows(state: ShardRequest, start: int, end: int) -> np.ndarray:
    """[3, end - start] M-RoPE positions of tokens [start, end): the prompt's own rows, then
    index + rope_delta on all three rows for tokens after the rows computed at admission."""
    assert state.mrope is not None
    known = state.mrope.shape[1]
    head = state.mrope[:, start:min(end, known)]
    tail = np.arange(max(start, known), end, dtype=np.int64) + state.rope_delta
    return np.concatenate([head, np.tile(tail, (3, 1))], axis=1)
