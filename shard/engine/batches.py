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

import math
import time
from array import array
from dataclasses import dataclass, field

import tokenizers
import torch

from shard.engine.contracts import (
    BatchSpec,
    BlockGrant,
    CachedBatchRef,
    FinishedText,
    Generation,
    RequestSpec,
    StepResult,
    StepTimings,
    TokenList,
)
from shard.engine.detokenizer import IncrementalDetokenizer
from shard.engine.grammar import GrammarEngine, GrammarState, MaskJob, apply_token_bitmask
from shard.engine.sampling import SampleOutput, Sampler, SamplingParams, prompt_logprobs
from shard.engine.stopping import StoppingCriteria, StopReason
from shard.errors import (
    FailedPreconditionError,
    FatalDeviceError,
    InvalidRequestError,
    NotFoundError,
)
from shard.lora import LoraManager
from shard.runner.model_runner import ModelRunner, StepInputs


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
    detok: IncrementalDetokenizer
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


@dataclass
class _Work:
    """One sequence of a step: compute token_ids[start:start + length] (with drafts: the last
    token, then the drafts; length = 1 + len(drafts))."""

    state: ShardRequest
    start: int
    length: int
    samples: bool  # the step ends at the sequence's last known token: sample the next one
    drafts: list[int] | tuple[()] = ()  # draft tokens to verify (speculative decoding)


class BatchState:
    """The requests and batches of one rank, keyed by router ids; each call (prefill, decode,
    filter_batch, clear_cache) runs on the single model worker thread."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: tokenizers.Tokenizer,
        eos_token_ids: set[int],
        max_position_embeddings: int,
        lora: LoraManager | None = None,
    ):
        self.runner = runner
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
        special = tokenizer.get_added_tokens_decoder()
        self._special = {i for i, tok in special.items() if tok.special}

    # ---- state management -------------------------------------------------------------------

    def _new_state(self, spec: RequestSpec) -> ShardRequest:
        if spec.generated_len > len(spec.input_ids):
            raise InvalidRequestError(f"request {spec.id}: generated_len exceeds input_ids")
        prompt_len = len(spec.input_ids) - spec.generated_len
        prompt = list(spec.input_ids[:prompt_len])
        detok = IncrementalDetokenizer(self.tokenizer, prompt)
        visible_text = []
        for token in spec.input_ids[prompt_len:]:  # replay generations from before a preemption
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
                self.eos_token_ids, spec.max_new_tokens, spec.stop_sequences, spec.ignore_eos_token
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

    def _apply_grants(self, grants: list[BlockGrant]) -> None:
        for grant in grants:
            self._request(grant.request_id).blocks.extend(grant.blocks)

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
        t0 = time.perf_counter_ns()
        if self.runner.kv_cache is None:
            raise FailedPreconditionError("Warmup must run before Prefill")
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
        work: list[_Work] = []
        new_ids: list[int] = []
        for spec in batch.requests:
            end = spec.cache_len + spec.chunk_len
            state = self.requests.get(spec.id)
            if state is None or spec.cache_len == 0:
                state = self._new_state(spec)
                self.requests[spec.id] = state
            else:  # next chunk: the router replaces block table and cursor
                state.blocks = list(spec.blocks)
                state.blocks_checked = 0
                state.computed_len = spec.cache_len
            work.append(_Work(state, spec.cache_len, spec.chunk_len, end == len(state.token_ids)))
            new_ids.append(spec.id)
        self._apply_grants(grants)
        chunked = set(new_ids)
        cached_ids = list(cached.request_ids) if cached else []
        for rid in cached_ids:
            if rid in chunked:
                continue
            state = self._request(rid)
            if state.computed_len != len(state.token_ids) - 1:
                continue  # still prefilling and no chunk this step: it waits
            work.append(self._decode_work(state, drafts))
        self._check_drafts(drafts, work)
        merged = cached_ids + [rid for rid in new_ids if rid not in set(cached_ids)]
        if cached and cached.id != batch.id:
            self.batches.pop(cached.id, None)
        generations = self._step(work, t0)
        return self._finish_step(batch.id, merged, generations)

    def decode(
        self,
        batches: list[CachedBatchRef],
        grants: list[BlockGrant],
        drafts: dict[int, list[int]] | None = None,
    ) -> StepResult:
        t0 = time.perf_counter_ns()
        if not batches:
            raise InvalidRequestError("Decode needs at least one batch")
        self._apply_grants(grants)
        merged: list[int] = []
        work: list[_Work] = []
        for ref in batches:
            for rid in ref.request_ids:
                state = self._request(rid)
                merged.append(rid)
                if state.computed_len == len(state.token_ids) - 1:
                    work.append(self._decode_work(state, drafts))
                # else: still prefilling (its next chunk comes with a Prefill); it waits
        self._check_drafts(drafts, work)
        for ref in batches[1:]:
            self.batches.pop(ref.id, None)
        generations = self._step(work, t0)
        return self._finish_step(batches[0].id, merged, generations)

    def filter_batch(self, batch_id: int, keep: list[int]) -> CachedBatchRef:
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
        if batch_id is None:
            self.requests.clear()
            self.batches.clear()
            return
        self._forget(self.batches.pop(batch_id, []))

    # ---- one step -----------------------------------------------------------------------------

    def _finish_step(self, batch_id: int, merged: list[int], step: tuple) -> StepResult:
        generations, timings = step
        alive = [rid for rid in merged if rid in self.requests]
        if alive:
            self.batches[batch_id] = alive
            ref = CachedBatchRef(batch_id, alive)
        else:
            self.batches.pop(batch_id, None)
            ref = None
        return StepResult(generations, ref, timings)

    def _decode_inputs(self, work: list[_Work]) -> StepInputs:
        """StepInputs of a step whose sequences all compute one token and sample (the usual
        decode step): built with one comprehension per field instead of per-row appends. A
        one-token step never reaches a prompt-logprob row (its start is >= prompt_len - 1)."""
        for w in work:
            self._check_state_blocks(w.state, w.start + 1)
        starts = [w.start for w in work]
        n = len(work)
        return StepInputs(
            token_ids=[w.state.token_ids[w.start] for w in work],
            positions=starts,
            query_lens=[1] * n,
            seq_lens=[s + 1 for s in starts],
            block_tables=[w.state.blocks for w in work],
            logits_indices=list(range(n)),
            lora_slots=self._lora_slots(work),
        )

    def _lora_slots(self, work: list[_Work]) -> list[int] | None:
        """Each sequence's device slot of its adapter (-1: none), swapping adapters in; None
        when no sequence of the step has one."""
        if self.lora is None or not any(w.state.adapter for w in work):
            return None
        return self.lora.slots_for([w.state.adapter for w in work], self.adapters_in_use)

    def adapters_in_use(self) -> set[str]:
        """Adapters of the requests this rank holds (never evicted from their slots)."""
        return {r.adapter for r in self.requests.values() if r.adapter}

    def _step(self, work: list[_Work], t0: int) -> tuple[list[Generation], StepTimings]:
        if work and all(w.length == 1 and w.samples for w in work):
            return self._run_step(work, self._decode_inputs(work), len(work), [], [], [], t0)
        inputs = StepInputs([], [], [], [], [], [])
        sample_rows: list[int] = []
        lp_rows: list[int] = []  # rows whose logits give a prompt token's logprob
        lp_next: list[int] = []
        lp_owner: list[ShardRequest] = []
        for w in work:
            seq_len = w.start + w.length
            self._check_state_blocks(w.state, seq_len)
            base = len(inputs.token_ids)
            if w.drafts:  # the last token, then the drafts
                inputs.token_ids.append(w.state.token_ids[w.start])
                inputs.token_ids.extend(w.drafts)
            else:
                inputs.token_ids.extend(w.state.token_ids[w.start : seq_len])
            inputs.positions.extend(range(w.start, seq_len))
            inputs.query_lens.append(w.length)
            inputs.seq_lens.append(seq_len)
            inputs.block_tables.append(w.state.blocks)
            if w.state.prefill_logprobs:
                for p in range(w.start, min(seq_len, w.state.prompt_len - 1)):
                    lp_rows.append(base + p - w.start)
                    lp_next.append(w.state.token_ids[p + 1])
                    lp_owner.append(w.state)
            if w.drafts:  # every position samples: the last token's and each draft's
                sample_rows.extend(range(base, base + w.length))
            elif w.samples:
                sample_rows.append(base + w.length - 1)
        inputs.logits_indices = sample_rows + lp_rows
        inputs.lora_slots = self._lora_slots(work)
        return self._run_step(work, inputs, len(sample_rows), lp_rows, lp_next, lp_owner, t0)

    def _run_step(
        self,
        work: list[_Work],
        inputs: StepInputs,
        num_samples: int,  # the first num_samples logits rows sample; prompt-logprob rows follow
        lp_rows: list[int],
        lp_next: list[int],
        lp_owner: list[ShardRequest],
        t0: int,
    ) -> tuple[list[Generation], StepTimings]:
        timings = StepTimings()
        t1 = time.perf_counter_ns()
        timings.prepare_ns = t1 - t0
        sampling = [w for w in work if w.samples]
        # The bitmask of the constrained rows is filled on the mask thread while the forward runs.
        masks = self._start_masks(sampling)
        try:
            logits = self.runner.execute(inputs)  # [num_logits, vocab]
        except Exception as exc:  # the KV cache may be half-written: the shard cannot go on
            if masks is not None:
                masks.join()  # never leave the fill running past a dead step
            raise FatalDeviceError(f"forward pass failed: {type(exc).__name__}: {exc}") from exc
        if masks is not None:
            # [num_samples, vocab]: disallowed tokens -> -inf on the device, before sampling
            apply_token_bitmask(logits[:num_samples], masks.wait(logits.device))
        try:
            if logits.device.type == "cuda":
                torch.cuda.synchronize(logits.device)
        except Exception as exc:
            raise FatalDeviceError(f"forward pass failed: {type(exc).__name__}: {exc}") from exc
        t2 = time.perf_counter_ns()
        timings.forward_ns = t2 - t1
        for w in work:  # rows with drafts advance by what they emit (_emit_verified)
            w.state.computed_len = w.start + w.length
        if lp_rows:
            values = prompt_logprobs(
                logits[num_samples:], torch.tensor(lp_next, device=logits.device)
            )
            for state, value in zip(lp_owner, values):
                state.prompt_lps.append(value)
        generations = self._sample(sampling, logits[:num_samples])
        t3 = time.perf_counter_ns()
        timings.decode_ns = t3 - t2
        timings.total_ns = t3 - t0
        return generations, timings

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

    def _sample(self, work: list[_Work], logits: torch.Tensor) -> list[Generation]:
        """logits [rows, vocab]: one row per sampling sequence, 1 + len(drafts) for one with
        drafts (its positions in order)."""
        if not work:
            return []
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
            counts = [s.generated_count for s in states]
            top_n = [s.top_n for s in states]
        out = self.sampler.sample(logits, params, histories, counts, top_n)
        generations = []
        row = 0
        for w in work:
            state = w.state
            if w.drafts:
                generations.append(self._emit_verified(w, out, row))
                row += w.length
                continue
            token = out.token_ids[row]
            # The first sampled token completes the prompt: emit its logprobs once.
            prefill_tokens = self._prefill_tokens(state) if state.prefill_logprobs else None
            text, is_special, finished = self._accept(state, token)
            top = [self._top(out, row)] if state.top_n else []
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
        text = state.detok.push(token)
        is_special = token in self._special
        if not is_special:
            state.visible_text.append(text)
        stopping = state.stopping
        # Only stop sequences read the text: joining it every step is O(length) per row.
        so_far = state.detok.text if stopping.stop_sequences else ""
        reason = stopping.check(token, so_far, state.generated_count)
        if state.grammar is not None:
            state.grammar.pending.append(token)  # consumed by the next step's mask job
            if reason is None and token in self.eos_token_ids:
                reason = StopReason.EOS_TOKEN  # a finished grammar allows nothing after EOS
        finished = None
        if reason is not None:
            held_back = state.detok.flush()
            text += held_back
            state.visible_text.append(held_back)
            finished = FinishedText(
                text="".join(state.visible_text),
                generated_tokens=state.generated_count,
                finish_reason=reason,
                seed=state.sampling.seed if state.sampling.do_sample else None,
            )
            del self.requests[state.id]
        return text, is_special, finished

    def _top(self, out: SampleOutput, row: int) -> TokenList:
        special = self._special
        return TokenList(
            ids=list(out.top_ids[row]),
            logprobs=list(out.top_logprobs[row]),
            texts=[self._text(t) for t in out.top_ids[row]],
            is_special=[t in special for t in out.top_ids[row]],
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
                tops.append(self._top(out, row + j))
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
            texts=[self._text(t) for t in ids],
            is_special=[t in self._special for t in ids],
        )
