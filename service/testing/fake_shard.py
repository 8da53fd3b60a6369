"""An instant test-double shard: a real grpc.aio ShardService with deterministic fake tokens.

It honours the protocol the router relies on and checks it strictly, failing the RPC with
FAILED_PRECONDITION on any violation:
- every slot a step writes lies in the request's blocks, in range, and in no block another live
  request references (shared blocks are read-only prefix blocks);
- K/V "content" is simulated: each slot remembers the token written there, and a prefill with
  cache_len > 0 must find exactly its input tokens in the slots it claims are cached (this checks
  the router's prefix cache and block tables end to end);
- like the real shard, a cached request decodes when its K/V cover all but its last known token
  and otherwise waits; a token the router did not plan for fails the router's own checks.

Tokens depend only on (prompt, seed, generated index), so preemption and batching never change
the output: `expected_tokens` gives the sequence a request must produce. Never used by the
end-to-end tests (they run the real shard).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
from tokenwire.shard.v1 import shard_pb2 as pb
from tokenwire.shard.v1 import shard_pb2_grpc as pb_grpc

VOCAB = 32000


def expected_tokens(prompt: list[int], n: int, seed: int = 0) -> list[int]:
    """Tokens the fake shard generates for `prompt` (n of them)."""
    base = (sum(prompt) * 31 + len(prompt) * 7 + seed) % VOCAB
    return [(base + 17 * i) % (VOCAB - 2) + 2 for i in range(n)]


def token_text(token: int) -> str:
    return f" t{token}"


@dataclass
class FakeShardConfig:
    num_blocks: int = 1024
    block_size: int = 16
    check_kv: bool = True  # simulate and verify K/V slot contents
    step_delay_s: float = 0.0  # sleep in each Prefill/Decode (to keep requests in flight)
    fail_after_steps: int | None = None  # abort every step after this many with UNAVAILABLE
    eos_token_id: int | None = None  # emit EOS as the 2nd token when set (and not ignored)
    # a MoE model's routing window (tokens per expert) attached to every step's answer
    expert_load: tuple[int, ...] | None = None


@dataclass
class _Req:
    rid: int
    prompt: list[int]
    tokens: list[int]  # prompt + generated
    blocks: list[int]
    computed: int
    max_new: int
    seed: int
    ignore_eos: bool
    prefill_logprobs: bool
    top_n: int
    prefill_done: bool = False
    expected: list[int] = field(default_factory=list)


class _Violation(Exception):
    pass


class FakeShard(pb_grpc.ShardServiceServicer):
    def __init__(self, config: FakeShardConfig, url: str = "") -> None:
        self.config = config
        self.url = url
        self.reqs: dict[int, _Req] = {}
        self.batches: dict[int, list[int]] = {}
        self.kv: list[int] = (
            [-1] * (config.num_blocks * config.block_size) if config.check_kv else []
        )
        self.block_users: dict[int, int] = {}  # block -> live requests referencing it
        self.steps = 0
        self.prefill_calls = 0
        self.decode_calls = 0
        self.filter_calls = 0
        self.prefill_tokens = 0
        self.generated_tokens = 0  # tokens generated for all requests (cancelled ones included)
        # Overlapped steps (step_index > 0): run in index order; a step (or a filter) may name
        # requests that finished at a step whose answer the router had not read yet.
        self.overlapped_steps = 0
        self._launched = 0
        self._turn = asyncio.Condition()
        self._finished_recent: set[int] = set()

    def _ref(self, blocks) -> None:
        users = self.block_users
        for b in blocks:
            users[b] = users.get(b, 0) + 1

    def _unref(self, blocks) -> None:
        users = self.block_users
        for b in blocks:
            n = users[b] - 1
            if n:
                users[b] = n
            else:
                del users[b]

    def _forget(self, rid: int) -> None:
        r = self.reqs.pop(rid, None)
        if r is not None:
            self._unref(r.blocks)

    # --- control --------------------------------------------------------------------------
    async def Info(self, request, context):
        return pb.InfoResponse(
            dtype="float32",
            device_type="cpu",
            block_size=self.config.block_size,
            max_position_embeddings=1 << 20,
            eos_token_ids=[] if self.config.eos_token_id is None else [self.config.eos_token_id],
            model_type="fake",
            vocab_size=VOCAB,
            world_size=1,
            attention_backend="fake",
            model_id="fake-shard",
        )

    async def ServiceDiscovery(self, request, context):
        return pb.ServiceDiscoveryResponse(urls=[self.url] if self.url else [])

    async def Health(self, request, context):
        return pb.HealthResponse()

    async def Warmup(self, request, context):
        c = self.config
        return pb.WarmupResponse(
            num_blocks=c.num_blocks,
            block_size=c.block_size,
            max_supported_total_tokens=c.num_blocks * c.block_size,
            warmup_ns=1,
        )

    async def ClearCache(self, request, context):
        if request.HasField("id"):
            for rid in self.batches.pop(request.id, []):
                self._forget(rid)
        else:
            self.batches.clear()
            self.reqs.clear()
            self.block_users.clear()
            self._finished_recent.clear()
            async with self._turn:
                self._launched = 0
                self._turn.notify_all()
        return pb.ClearCacheResponse()

    async def FilterBatch(self, request, context):
        self.filter_calls += 1
        ids = self.batches.get(request.batch_id)
        if ids is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"batch {request.batch_id} not found")
        keep = set(request.request_ids)
        if self.overlapped_steps:
            keep -= self._finished_recent
        unknown = keep.difference(ids)
        if unknown:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"unknown ids {unknown}")
        for rid in ids:
            if rid not in keep:
                self._forget(rid)
        kept = [rid for rid in ids if rid in keep]
        self.batches[request.batch_id] = kept
        return pb.FilterBatchResponse(batch=pb.CachedBatch(id=request.batch_id, request_ids=kept))

    # --- steps ------------------------------------------------------------------------------
    async def _before_step(self, context) -> None:
        self.steps += 1
        c = self.config
        if c.fail_after_steps is not None and self.steps > c.fail_after_steps:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake shard failure")
        if c.step_delay_s:
            await asyncio.sleep(c.step_delay_s)

    def _take_batch(self, cached: pb.CachedBatch, unseen: set[int] | None = None) -> list[int]:
        """unseen (overlapped steps): requests that finished unknown to the router."""
        if unseen is not None:
            ids = self.batches.pop(cached.id, [])  # gone when all of it finished
            named = [rid for rid in cached.request_ids if rid not in unseen]
            if named != ids:
                raise _Violation(f"cached batch {cached.id}: ids {named} != {ids}")
            return ids
        ids = self.batches.pop(cached.id, None)
        if ids is None:
            raise _Violation(f"cached batch {cached.id} not found")
        if list(cached.request_ids) != ids:
            raise _Violation(f"cached batch {cached.id}: ids {list(cached.request_ids)} != {ids}")
        return ids

    def _grant(self, grants, unseen: set[int] | None = None) -> None:
        for g in grants:
            r = self.reqs.get(g.request_id)
            if r is None and unseen is not None and g.request_id in unseen:
                continue  # finished at the step before (overlap)
            if r is None:
                raise _Violation(f"grant for unknown request {g.request_id}")
            r.blocks.extend(g.blocks)
            self._ref(g.blocks)

    def _check_write(self, r: _Req, start: int, end: int) -> None:
        """Positions [start, end) of r are written: their blocks must be in range and r's alone
        (shared blocks are read-only prefix blocks)."""
        bs = self.config.block_size
        if end > len(r.blocks) * bs:
            raise _Violation(f"request {r.rid}: {len(r.blocks)} blocks cannot hold {end} tokens")
        users = self.block_users
        n = self.config.num_blocks
        for b in r.blocks[start // bs : (end - 1) // bs + 1]:
            if not 0 <= b < n:
                raise _Violation(f"request {r.rid}: block {b} out of range")
            if users.get(b, 0) != 1:
                raise _Violation(
                    f"request {r.rid} writes block {b} that {users.get(b, 0) - 1} other "
                    "request(s) also use"
                )

    def _write(self, r: _Req, start: int, end: int) -> None:
        if not self.config.check_kv:
            return
        bs = self.config.block_size
        kv = self.kv
        for p in range(start, end):
            kv[r.blocks[p // bs] * bs + p % bs] = r.tokens[p]

    def _check_cached(self, r: _Req, cache_len: int) -> None:
        if not self.config.check_kv:
            return
        bs = self.config.block_size
        for p in range(cache_len):
            slot = r.blocks[p // bs] * bs + p % bs
            if self.kv[slot] != r.tokens[p]:
                raise _Violation(
                    f"request {r.rid}: cached position {p} holds token {self.kv[slot]}, "
                    f"expected {r.tokens[p]}"
                )

    def _generate(self, r: _Req) -> pb.Generation:
        gen_idx = len(r.tokens) - len(r.prompt)
        token = r.expected[gen_idx] if gen_idx < len(r.expected) else 2
        if self.config.eos_token_id is not None and gen_idx == 1 and not r.ignore_eos:
            token = self.config.eos_token_id
        r.tokens.append(token)
        self.generated_tokens += 1
        g = pb.Generation(
            request_id=r.rid,
            tokens=pb.Tokens(
                ids=[token], logprobs=[-0.5], texts=[token_text(token)], is_special=[False]
            ),
        )
        if r.top_n:
            alts = [token + k for k in range(r.top_n)]
            g.top_tokens.append(
                pb.Tokens(
                    ids=alts,
                    logprobs=[-0.5 - k for k in range(r.top_n)],
                    texts=[token_text(t) for t in alts],
                    is_special=[False] * r.top_n,
                )
            )
        n = gen_idx + 1
        reason = 0
        if token == self.config.eos_token_id and self.config.eos_token_id is not None:
            reason = pb.FINISH_REASON_EOS_TOKEN
        elif n >= r.max_new:
            reason = pb.FINISH_REASON_LENGTH
        if reason:
            text = "".join(token_text(t) for t in r.tokens[len(r.prompt) :])
            g.generated_text.CopyFrom(
                pb.GeneratedText(text=text, generated_tokens=n, finish_reason=reason, seed=r.seed)
            )
            self._forget(r.rid)
            self._finished_recent.add(r.rid)
        return g

    def _decode_one(self, r: _Req) -> pb.Generation:
        pos = len(r.tokens) - 1
        if r.computed != pos:
            raise _Violation(f"request {r.rid}: decode at {pos} but {r.computed} computed")
        self._check_write(r, pos, pos + 1)
        self._write(r, pos, pos + 1)
        r.computed = pos + 1
        return self._generate(r)

    def _unseen(self, step_index: int) -> set[int] | None:
        if not step_index:
            return None
        unseen, self._finished_recent = self._finished_recent, set()
        return unseen

    def _prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        self.prefill_calls += 1
        unseen = self._unseen(request.step_index)
        cached_ids: list[int] = []
        if request.HasField("cached_batch"):
            cached_ids = self._take_batch(request.cached_batch, unseen)
        self._grant(request.block_grants, unseen)
        in_batch = {q.id for q in request.batch.requests}
        gens: list[pb.Generation] = []
        order = list(cached_ids)
        for q in request.batch.requests:
            r = self.reqs.get(q.id)
            tokens = list(q.input_ids)
            prompt = tokens[: len(tokens) - q.generated_len]
            if r is None:
                r = _Req(
                    rid=q.id,
                    prompt=prompt,
                    tokens=tokens,
                    blocks=list(q.blocks),
                    computed=q.cache_len,
                    max_new=q.stopping.max_new_tokens,
                    seed=q.sampling.seed,
                    ignore_eos=q.stopping.ignore_eos_token,
                    prefill_logprobs=q.prefill_logprobs,
                    top_n=q.top_n_tokens,
                    expected=expected_tokens(prompt, q.stopping.max_new_tokens, q.sampling.seed),
                )
                self.reqs[q.id] = r
                self._ref(r.blocks)
                self._check_cached(r, q.cache_len)
                order.append(q.id)
            else:
                if q.id not in cached_ids:
                    raise _Violation(f"request {q.id} continues but is not in the cached batch")
                if r.prefill_done or q.cache_len != r.computed or tokens != r.tokens:
                    raise _Violation(
                        f"request {q.id}: chunk at {q.cache_len}, shard has {r.computed}"
                    )
                self._unref(r.blocks)
                r.blocks = list(q.blocks)
                self._ref(r.blocks)
            if q.prefill_logprobs and q.cache_len:
                raise _Violation(f"request {q.id}: prefill_logprobs with cache_len {q.cache_len}")
            end = q.cache_len + q.chunk_len
            if q.chunk_len == 0 or end > len(tokens):
                raise _Violation(
                    f"request {q.id}: chunk {q.cache_len}+{q.chunk_len} of {len(tokens)}"
                )
            self._check_write(r, q.cache_len, end)
            self._write(r, q.cache_len, end)
            r.computed = end
            self.prefill_tokens += q.chunk_len
            if end == len(tokens):
                r.prefill_done = True
                g = self._generate(r)
                if q.prefill_logprobs:
                    n = len(prompt)
                    g.prefill_tokens.CopyFrom(
                        pb.Tokens(
                            ids=prompt,
                            logprobs=[float("nan")] + [-1.0] * (n - 1),
                            texts=[token_text(t) for t in prompt],
                            is_special=[False] * n,
                        )
                    )
                gens.append(g)
        for rid in cached_ids:
            if rid in in_batch:
                continue
            r = self.reqs[rid]
            # Like the real shard: a cached request whose K/V cover all but its last known
            # token decodes; one still prefilling without a chunk this step waits.
            if r.computed == len(r.tokens) - 1:
                r.prefill_done = True
                gens.append(self._decode_one(r))
        # Overlapped steps: the merged batch takes the new Batch's id (the router sends the
        # next step before it reads this answer; shard.proto, step_index).
        batch_id = request.batch.id if unseen is not None else cached_batch_id(request)
        return self._answer(pb.PrefillResponse, gens, order, batch_id)

    def _decode(self, request: pb.DecodeRequest) -> pb.DecodeResponse:
        self.decode_calls += 1
        if not request.batches:
            raise _Violation("decode without batches")
        unseen = self._unseen(request.step_index)
        order: list[int] = []
        for b in request.batches:
            order.extend(self._take_batch(b, unseen))
        self._grant(request.block_grants, unseen)
        gens = []
        for rid in order:
            r = self.reqs[rid]
            if r.computed == len(r.tokens) - 1:
                r.prefill_done = True
                gens.append(self._decode_one(r))
        return self._answer(pb.DecodeResponse, gens, order, request.batches[0].id)

    def _answer(self, cls, gens, order, batch_id):
        t0 = time.perf_counter_ns()
        alive = [rid for rid in order if rid in self.reqs]
        resp = cls(generations=gens, timings=pb.Timings(forward_ns=1, total_ns=1))
        if self.config.expert_load is not None:
            resp.expert_load.tokens_per_expert.extend(self.config.expert_load)
            resp.expert_load.steps = 1
        if alive:
            self.batches[batch_id] = alive
            resp.batch.CopyFrom(pb.CachedBatch(id=batch_id, request_ids=alive))
        resp.timings.total_ns = time.perf_counter_ns() - t0
        return resp

    async def _in_turn(self, index: int, run, request, context):
        """Runs a step; overlapped ones (index > 0) in index order."""
        if index:
            self.overlapped_steps += 1
            async with self._turn:
                await self._turn.wait_for(lambda: self._launched >= index - 1)
        try:
            await self._before_step(context)
            try:
                return run(request)
            except _Violation as e:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        finally:
            if index:
                async with self._turn:
                    self._launched = max(self._launched, index)
                    self._turn.notify_all()

    async def Prefill(self, request, context):
        return await self._in_turn(request.step_index, self._prefill, request, context)

    async def Decode(self, request, context):
        return await self._in_turn(request.step_index, self._decode, request, context)


def cached_batch_id(request: pb.PrefillRequest) -> int:
    return request.cached_batch.id if request.HasField("cached_batch") else request.batch.id


async def start_fake_shard(
    config: FakeShardConfig | None = None, address: str = "127.0.0.1:0"
) -> tuple[grpc.aio.Server, FakeShard, str]:
    """Starts a fake shard on `address` (port 0: any free port); returns server, servicer, url."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", 256 << 20),
            ("grpc.max_receive_message_length", 256 << 20),
        ]
    )
    shard = FakeShard(config or FakeShardConfig())
    pb_grpc.add_ShardServiceServicer_to_server(shard, server)
    port = server.add_insecure_port(address)
    if address.startswith("unix:"):
        url = address
    else:
        url = f"{address.rsplit(':', 1)[0]}:{port}"
    shard.url = url
    await server.start()
    return server, shard, url
