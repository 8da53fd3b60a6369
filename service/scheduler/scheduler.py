"""Continuous-batching scheduler: one rule, a per-step token budget, lazy blocks, preemption.

Each step every running request's computed tokens catch up with its known tokens as far as the
budget allows: a decoding request computes 1 token (its last sample), a prefilling one takes the
next chunk of its prompt (from the prefix-cache hit, if any), a newly admitted one starts. Chunk
tokens share `max_batch_prefill_tokens` per step; decode tokens ride along (they are bounded by
`max_batch_size`). Blocks are granted lazily, exactly when a step writes past a request's last
block. When none is left (free or evictable), the youngest running request is preempted: its
blocks are freed, it goes back to the front of the queue keeping its generated tokens, and is
recomputed later as a prefill of prompt + generated tokens (with the prefix cache's help).

Admission of new requests while others decode follows TGI's two knobs, re-read for fused
chunked prefill (see `_may_admit`): a new prefill makes that step slower for every decoding
request, so new requests are admitted when (a) nothing is decoding, (b) the step already carries
prefill chunks anyway, (c) the queue holds at least `waiting_served_ratio` x the decoding batch,
or (d) requests have waited `max_waiting_tokens` decode steps.

Speculative decoding (service/scheduler/speculation.py): in a step with at most
`speculation.max_batch_size` running requests, a decoding request may carry up to
`speculation.num_tokens` n-gram draft tokens. Their positions' blocks are granted only from blocks
that are free beyond what the rest of the step may need (drafts never preempt anyone) and their
tokens come out of the chunk budget. After the step the request advances by the tokens the shard
emitted (1 + accepted drafts) and blocks that hold only rejected K/V are released: the shard cuts
its block table by the same rule (ceil(computed / block_size) blocks). Only blocks whose tokens
are all computed (accepted) ever reach the prefix cache.

Plain Python: no torch, no gRPC. The engine calls `add`/`abort` between steps, `schedule()` to
get a StepPlan, runs it on the shard, and feeds the StepOutput to `apply_output`.

Scheduling one step ahead (overlap): `schedule()` may run again before the previous plan's output
is applied. Each plan advances its requests' `computed` when it is made (a decode by one token, a
chunk by its length; one that completes the input decodes in the next plan), so the next plan
continues where the outstanding one will leave off; the tokens it samples are `pending` until
their output arrives. Outputs are applied in plan order. A request that finishes in the
outstanding plan is scheduled once more (its row is wasted; the shard drops it), unless it is
known to finish there (max_new_tokens: it is left out, `StepPlan.finishing`). The next plan
carries no drafts (they need the latest tokens: the engine applies the output first when it
wants them, see `wants_drafts`), and a preempted request is not readmitted while a token of it
is pending. Blocks enter the prefix cache when a plan's output is applied.
"""

from __future__ import annotations

from bisect import insort
from collections import deque
from dataclasses import dataclass, field

from service.scheduler.block_manager import BlockManager
from service.scheduler.contracts import ChunkWork, GenerationOut, StepOutput, StepPlan
from service.scheduler.speculation import SpeculationConfig, new_spec_state
from service.scheduler.state import RequestState, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_prefill_tokens: int = 4096  # chunk tokens per step, all requests together
    max_batch_size: int = 256  # requests per step (prefilling + decoding)
    waiting_served_ratio: float = 0.3  # admit when len(waiting) >= ratio * decoding requests
    max_waiting_tokens: int = 20  # ... or when requests waited this many decode steps
    # Distinct LoRA adapters running at once (the shards' --max-loras device slots); 0: no
    # adapters are served.
    max_adapters: int = 0
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)

    def __post_init__(self) -> None:
        if self.max_batch_prefill_tokens < 1:
            raise ValueError("max_batch_prefill_tokens must be >= 1")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")


@dataclass
class SchedulerCounters:
    prefill_tokens_computed: int = 0
    prefix_cache_hit_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    aborted: int = 0  # requests removed before they finished (cancel, deadline, shard failure)
    spec_proposed_tokens: int = 0  # draft tokens sent to the shard
    spec_accepted_tokens: int = 0  # draft tokens the shard accepted
    # spec_step_tokens[n]: sequence-steps with drafts that gave the sequence n tokens.
    spec_step_tokens: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest (smallest arrival) first
        self.seqs: dict[int, Sequence] = {}
        self.counters = SchedulerCounters()
        self.counters.spec_step_tokens = [0] * (config.speculation.num_tokens + 2)
        self._removed_from_shard: list[int] = []  # aborted on-shard requests not yet filtered
        self._steps_without_admission = 0
        # Plans made and not yet applied, oldest first: (chunk requests, decode requests).
        self._outstanding: deque[tuple[list[Sequence], list[Sequence]]] = deque()

    # --- queue --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._removed_from_shard)

    @property
    def outstanding(self) -> int:
        """Plans whose output is not applied yet."""
        return len(self._outstanding)

    def can_plan_ahead(self) -> bool:
        """Whether the next plan surely needs no preemption: blocks for every decode that
        crosses into a new block, and one for every running prefill. The engine applies the
        step in flight first otherwise (its finished requests' blocks come back then), so that
        scheduling ahead never preempts more than stepping one at a time would. Costs one pass
        over the running requests."""
        bs = self.blocks.block_size
        need = 0
        for seq in self.running:
            if not seq.prefill_done:
                need += 1
            elif seq.pending and 0 < seq.max_new_tokens <= seq.generated_len + seq.pending:
                continue  # finishes in the step in flight
            elif seq.computed >= len(seq.blocks) * bs:
                need += 1
        return need <= self.blocks.num_free

    def wants_drafts(self) -> bool:
        """True when the next plan would propose drafts if no plan were outstanding."""
        spec = self.config.speculation
        return spec.enabled and 0 < len(self.running) <= spec.max_batch_size

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs:
            raise ValueError(f"duplicate request id {seq.seq_id}")
        if not seq.token_ids:
            raise ValueError("empty input")
        seq.state = RequestState.WAITING
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: int, finished: bool = False) -> Sequence | None:
        """Removes a request (cancel, deadline). Call between steps only. finished: the caller
        ended it as finished (a stop sequence matched in the router's front end): its blocks
        go back the same way, but it does not count as aborted."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return None
        if seq.state is RequestState.WAITING:
            self.waiting.remove(seq)
        elif seq.state is RequestState.RUNNING:
            self.running.remove(seq)
            if seq.on_shard:
                self._removed_from_shard.append(seq_id)
                seq.on_shard = False
            self._free_blocks(seq)
        seq.state = RequestState.ABORTED
        if not finished:
            self.counters.aborted += 1
        return seq

    def abort_all(self) -> list[Sequence]:
        """Removes every request (shard failure); returns them."""
        out = list(self.seqs.values())
        for seq in out:
            self.abort(seq.seq_id)
        self._removed_from_shard.clear()
        self._outstanding.clear()  # their outputs will never be applied
        return out

    # --- the one place blocks go back -------------------------------------------------------
    def _free_blocks(self, seq: Sequence) -> None:
        if seq.blocks:
            self.blocks.release(seq.blocks)
        seq.blocks = []
        seq.block_hashes = []
        seq.computed = 0

    def _preempt_youngest(self, plan: StepPlan) -> Sequence:
        victim = self.running.pop()
        if victim.on_shard:
            plan.removed_from_shard.append(victim.seq_id)
            victim.on_shard = False
        self._free_blocks(victim)
        victim.state = RequestState.WAITING
        victim.prefill_done = False
        victim.scheduled = 0
        victim.preemptions += 1
        # Preempted youngest-first, so appendleft keeps the front in arrival order.
        self.waiting.appendleft(victim)
        plan.preempted.append(victim.seq_id)
        self.counters.preemptions += 1
        return victim

    # --- one step -----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        if self._removed_from_shard:
            plan.removed_from_shard.extend(self._removed_from_shard)
            self._removed_from_shard.clear()
        bm = self.blocks
        bs = bm.block_size
        budget = self.config.max_batch_prefill_tokens
        running = self.running
        chunks: list[Sequence] = []
        decodes: list[Sequence] = []
        decode_ids = plan.decode_ids
        grants = plan.grants
        spec = self.config.speculation
        speculate = spec.enabled and len(running) <= spec.max_batch_size and not self._outstanding

        i = 0
        while i < len(running):
            seq = running[i]
            if seq.prefill_done:
                if seq.pending and 0 < seq.max_new_tokens <= seq.generated_len + seq.pending:
                    # Its last token is being sampled by the step in flight: nothing to compute.
                    plan.finishing.append(seq.seq_id)
                    i += 1
                    continue
                # Decode: the step writes K/V at position `computed`.
                if seq.computed >= len(seq.blocks) * bs:
                    block = bm.allocate_one()
                    while block is None:
                        if self._preempt_youngest(plan) is seq:
                            break
                        block = bm.allocate_one()
                    if block is None:
                        break  # seq itself was the youngest and is now waiting
                    seq.blocks.append(block)
                    grants.append((seq.seq_id, [block]))
                seq.scheduled = 1
                decodes.append(seq)
                decode_ids.append(seq.seq_id)
                if speculate and budget > 0:
                    budget -= self._add_drafts(seq, plan, budget, len(running) - i - 1)
            elif budget > 0 or seq.computed == len(seq.token_ids) - 1:
                # A prefill one token short of its end always runs, over budget if need be:
                # a shard may treat a cached request with computed == len - 1 as decoding, and
                # it costs a decode's single token.
                chunk = self._fit_chunk(seq, budget if budget > 0 else 1)
                if chunk == 0:
                    if self._preempt_youngest(plan) is seq:
                        break
                    continue  # retry seq with the freed blocks
                budget = max(0, budget - chunk)
                chunks.append(seq)
            else:
                seq.scheduled = 0
            i += 1

        if self.waiting and budget > 0 and self._may_admit(len(decodes), bool(chunks)):
            admitted = 0
            max_batch = self.config.max_batch_size
            adapters: set[str] | None = None  # of the running requests, computed when needed
            while self.waiting and budget > 0 and len(running) < max_batch:
                seq = self.waiting[0]
                if seq.pending:
                    break  # preempted with a token still coming: its input is not known yet
                if seq.adapter:
                    if adapters is None:
                        adapters = {s.adapter for s in running if s.adapter}
                    if seq.adapter not in adapters:
                        if len(adapters) >= self.config.max_adapters:
                            break  # its adapter needs a device slot: wait for one (FCFS)
                        adapters.add(seq.adapter)
                first = not seq.blocks and seq.computed == 0
                if first and not seq.prefill_logprobs:
                    hit_blocks, hit_keys = bm.match_prefix(seq.token_ids, seq.cache_salt,
                                                            seq.images)
                    if hit_blocks:
                        seq.blocks = hit_blocks
                        seq.block_hashes = hit_keys
                        seq.computed = len(hit_blocks) * bs
                chunk = self._fit_chunk(seq, budget)
                if chunk == 0:
                    self._free_blocks(seq)  # give back the prefix hit; waiting holds nothing
                    break
                self.waiting.popleft()
                if seq.computed:
                    self.counters.prefix_cache_hit_tokens += seq.computed
                    if seq.preemptions == 0:
                        seq.prefix_hit_tokens = seq.computed
                seq.state = RequestState.RUNNING
                seq.recompute_generated = seq.generated_len
                if running and running[-1].arrival > seq.arrival:
                    insort(running, seq, key=_arrival)  # a preempted request coming back
                else:
                    running.append(seq)
                budget -= chunk
                chunks.append(seq)
                admitted += 1
            if admitted:
                self._steps_without_admission = 0
        if self.waiting and not chunks:
            self._steps_without_admission += 1

        if plan.removed_from_shard:
            plan.keep_ids = [s.seq_id for s in running if s.on_shard]
        for seq in chunks:
            seq.on_shard = True
            plan.chunks.append(
                ChunkWork(
                    seq_id=seq.seq_id,
                    input_ids=seq.token_ids,
                    cache_len=seq.computed,
                    chunk_len=seq.scheduled,
                    blocks=seq.blocks,
                    generated_len=seq.recompute_generated,
                    prefill_logprobs=seq.prefill_logprobs,
                    payload=seq.payload,
                )
            )
        # Advance now: a plan made before this one's output arrives continues from here.
        counters = self.counters
        for seq in chunks:
            seq.computed += seq.scheduled
            counters.prefill_tokens_computed += seq.scheduled
            seq.scheduled = 0
            if seq.computed == len(seq.token_ids):  # the chunk completes the input: it samples
                seq.prefill_done = True
                seq.pending += 1
        for seq in decodes:
            seq.scheduled = 0
            seq.pending += 1
            if not seq.drafts:
                seq.computed += 1  # with drafts: by the tokens emitted (_settle_drafts)
        if chunks or decodes:  # an empty plan is never run, so never applied
            self._outstanding.append((chunks, decodes))
        return plan

    def _add_drafts(self, seq: Sequence, plan: StepPlan, budget: int, others: int) -> int:
        """Proposes drafts for decoding `seq` (at most `budget` tokens), grants their blocks from
        blocks no one else in the step may need (`others` requests after it might each need
        one), records them in `plan`; returns the number of draft tokens."""
        state = seq.spec
        if state is None:
            if not seq.speculate:
                return 0
            # Created at the first step that may draft for it: a request that only ever runs in
            # large steps (no drafts) never builds a proposer.
            state = seq.spec = new_spec_state(self.config.speculation)
        elif state.cooldown > 0:  # backed off: nothing else to do for it this step
            state.cooldown -= 1
            return 0
        k = min(self.config.speculation.num_tokens, budget)
        if seq.max_new_tokens:
            # The step emits up to k + 1 tokens; none past max_new_tokens.
            k = min(k, seq.max_new_tokens - seq.generated_len - 1)
        if k <= 0:
            return 0
        bm = self.blocks
        bs = bm.block_size
        have = len(seq.blocks)
        spare = bm.num_free - others
        fits = (have + max(spare, 0)) * bs - seq.computed - 1  # draft positions that fit
        k = min(k, fits)
        if k <= 0:
            return 0
        drafts = state.propose(seq.token_ids, k)
        if not drafts:
            return 0
        need = bm.blocks_needed(seq.computed + 1 + len(drafts), have)
        if need:
            granted = bm.allocate(need)
            assert granted is not None  # need <= spare <= num_free
            seq.blocks.extend(granted)
            grants = plan.grants
            if grants and grants[-1][0] == seq.seq_id:
                grants[-1][1].extend(granted)
            else:
                grants.append((seq.seq_id, granted))
        seq.drafts = drafts
        plan.drafts.append((seq.seq_id, drafts))
        return len(drafts)

    def _settle_drafts(self, seq: Sequence, gen: GenerationOut) -> None:
        """After a step that verified seq's drafts (its tokens are appended): advance it by the
        tokens emitted, release the blocks that hold only rejected K/V, publish full blocks."""
        proposed = len(seq.drafts)
        emitted = gen.num_tokens
        if emitted > proposed + 1:
            raise ProtocolError(
                f"request {seq.seq_id}: {emitted} tokens for {proposed} drafts"
            )
        seq.drafts = []
        bm = self.blocks
        seq.computed += emitted
        keep = -(-seq.computed // bm.block_size)
        if len(seq.blocks) > keep:
            bm.release(seq.blocks[keep:])
            del seq.blocks[keep:]
        bm.register_full_blocks(
            seq.token_ids, seq.blocks, seq.block_hashes, seq.computed, seq.cache_salt,
            seq.images,
        )
        c = self.counters
        c.spec_proposed_tokens += proposed
        c.spec_accepted_tokens += emitted - 1
        c.spec_step_tokens[emitted] += 1
        if seq.spec is not None:
            seq.spec.record(proposed, emitted - 1, self.config.speculation)

    def _fit_chunk(self, seq: Sequence, budget: int) -> int:
        """Grants blocks for seq's next chunk (at most `budget` tokens, shrunk to the blocks
        available) and sets seq.scheduled; returns the chunk length (0: no block available)."""
        bm = self.blocks
        bs = bm.block_size
        remaining = len(seq.token_ids) - seq.computed
        chunk = min(budget, remaining)
        have = len(seq.blocks)
        need = bm.blocks_needed(seq.computed + chunk, have)
        if need:
            available = bm.num_free
            if need > available:
                fits = (have + available) * bs - seq.computed
                if fits <= 0:
                    seq.scheduled = 0
                    return 0
                chunk = fits
                need = available
            granted = bm.allocate(need)
            assert granted is not None
            seq.blocks.extend(granted)
        seq.scheduled = chunk
        return chunk

    def _may_admit(self, num_decoding: int, step_has_chunks: bool) -> bool:
        if num_decoding == 0 or step_has_chunks:
            return True
        if self._steps_without_admission >= self.config.max_waiting_tokens:
            return True
        return len(self.waiting) >= self.config.waiting_served_ratio * num_decoding

    def apply_output(self, plan: StepPlan, output: StepOutput) -> list[Sequence]:
        """Applies the oldest outstanding plan's output (`plan`): records full blocks, appends
        the tokens; returns the requests that finished (blocks freed)."""
        bm = self.blocks
        bs = bm.block_size
        counters = self.counters
        counters.steps += 1
        # An empty plan recorded nothing (see schedule); applying one is a no-op step.
        chunks, decodes = self._outstanding.popleft() if not plan.empty else ([], [])
        running = RequestState.RUNNING
        for group in (chunks, decodes):
            for seq in group:
                if seq.state is not running or seq.drafts:
                    continue  # preempted or gone; drafts: settled with their generation
                # K/V of every known token is computed once this plan has run (a plan made
                # after it may have advanced `computed` further).
                computed = min(seq.computed, len(seq.token_ids))
                if len(seq.block_hashes) < computed // bs:
                    bm.register_full_blocks(
                        seq.token_ids, seq.blocks, seq.block_hashes, computed, seq.cache_salt,
                        seq.images,
                    )

        finished: list[Sequence] = []
        seqs = self.seqs
        for gen in output.generations:
            seq = seqs.get(gen.seq_id)
            if seq is None:
                continue  # aborted while the step ran: filtered at the next boundary
            if seq.pending <= 0:
                raise ProtocolError(f"request {seq.seq_id}: token before its prefill ended")
            seq.pending -= 1
            seq.prefill_logprobs = False  # sent once; a recompute does not resend them
            seq.token_ids.append(gen.token.id)
            if gen.more:
                seq.token_ids.extend(t.id for t, _ in gen.more)
            if seq.state is RequestState.WAITING:  # preempted after this plan was made
                if gen.more:
                    raise ProtocolError(f"request {seq.seq_id}: several tokens without drafts")
                if gen.finish is not None:
                    self.waiting.remove(seq)
                    seq.state = RequestState.FINISHED
                    del seqs[seq.seq_id]
                    finished.append(seq)
                continue
            if seq.drafts:
                self._settle_drafts(seq, gen)
            elif gen.more:
                raise ProtocolError(f"request {seq.seq_id}: several tokens without drafts")
            if gen.finish is not None:
                seq.on_shard = False  # the shard forgot it
                seq.state = RequestState.FINISHED
                del seqs[seq.seq_id]
                self._free_blocks(seq)
                finished.append(seq)
        if finished:
            self.running = [s for s in self.running if s.state is RequestState.RUNNING]
        return finished


class ProtocolError(RuntimeError):
    """The shard's answer contradicts the step the router sent."""


def _arrival(seq: Sequence) -> int:
    return seq.arrival
