"""A minimal stand-in for the router in shard tests: owns the KV blocks, grants them lazily,
sends proto Prefill/Decode/FilterBatch calls through `call(method, request) -> response`, and
records what every request generated."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenwire.shard.v1 import shard_pb2 as pb

Call = Callable[[str, object], object]


@dataclass
class SimRequest:
    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: pb.SamplingParameters
    prefill_logprobs: bool = False
    top_n: int = 0
    stop_sequences: tuple[str, ...] = ()
    ignore_eos: bool = True
    generated_len: int = 0  # tail of `prompt` generated before a preemption (recompute)
    adapter: str = ""  # LoRA adapter name ("" base model)
    grammar: pb.OutputGrammar | None = None  # constrained decoding
    images: list[pb.ImageInput] = field(default_factory=list)  # sent with every chunk
    computed: int = 0  # tokens whose K/V the shard holds
    blocks: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    generations: list[pb.Generation] = field(default_factory=list)
    finished: pb.GeneratedText | None = None

    @property
    def known(self) -> list[int]:
        return self.prompt + self.generated


class RouterSim:
    def __init__(self, call: Call, num_blocks: int, block_size: int):
        self.call = call
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks))
        self.requests: dict[int, SimRequest] = {}
        self.done: dict[int, SimRequest] = {}
        self.batch: pb.CachedBatch | None = None
        self._next_batch = 1
        self.blocks_ever_used: set[int] = set()

    def add(self, rid: int, prompt: list[int], max_new_tokens: int = 32, **kw) -> SimRequest:
        sampling = kw.pop("sampling", None) or pb.SamplingParameters(
            temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0
        )
        req = SimRequest(rid, list(prompt), max_new_tokens, sampling, **kw)
        self.requests[rid] = req
        return req

    def _ensure(self, req: SimRequest, tokens: int) -> list[int]:
        need = math.ceil(tokens / self.block_size) - len(req.blocks)
        new = [self.free.pop(0) for _ in range(max(need, 0))]
        self.blocks_ever_used.update(new)
        req.blocks.extend(new)
        return new

    def _release(self, req: SimRequest) -> None:
        self.free.extend(req.blocks)
        req.blocks = []

    def _decode_grants(self) -> list[pb.BlockGrant]:
        grants = []
        for rid in self.batch.request_ids if self.batch else []:
            req = self.requests[rid]
            if req.computed == len(req.known) - 1:
                new = self._ensure(req, len(req.known))
                if new:
                    grants.append(pb.BlockGrant(request_id=rid, blocks=new))
        return grants

    def prefill(self, chunks: list[tuple[int, int]]) -> pb.PrefillResponse:
        """chunks: (request id, chunk_len or 0 for the rest of its prompt)."""
        grants = self._decode_grants()
        requests = []
        for rid, chunk in chunks:
            req = self.requests[rid]
            chunk = chunk or len(req.prompt) - req.computed
            self._ensure(req, req.computed + chunk)
            requests.append(
                pb.Request(
                    id=rid,
                    input_ids=req.prompt,
                    cache_len=req.computed,
                    chunk_len=chunk,
                    blocks=req.blocks,
                    sampling=req.sampling,
                    stopping=pb.StoppingParameters(
                        max_new_tokens=req.max_new_tokens,
                        stop_sequences=list(req.stop_sequences),
                        ignore_eos_token=req.ignore_eos,
                    ),
                    prefill_logprobs=req.prefill_logprobs,
                    top_n_tokens=req.top_n,
                    generated_len=req.generated_len,
                    adapter_id=req.adapter,
                    grammar=req.grammar,
                    images=req.images,
                )
            )
            req.computed += chunk
        msg = pb.PrefillRequest(
            batch=pb.Batch(id=self._next_batch, requests=requests), block_grants=grants
        )
        self._next_batch += 1
        if self.batch is not None:
            msg.cached_batch.CopyFrom(self.batch)
            for rid in self.batch.request_ids:
                req = self.requests[rid]
                if req.computed == len(req.known) - 1:
                    req.computed += 1
        resp = self.call("Prefill", msg)
        self._absorb(resp)
        return resp

    def decode(self) -> pb.DecodeResponse:
        grants = self._decode_grants()
        for rid in self.batch.request_ids:
            req = self.requests[rid]
            if req.computed == len(req.known) - 1:
                req.computed += 1
        resp = self.call("Decode", pb.DecodeRequest(batches=[self.batch], block_grants=grants))
        self._absorb(resp)
        return resp

    def filter(self, keep: list[int]) -> None:
        resp = self.call(
            "FilterBatch", pb.FilterBatchRequest(batch_id=self.batch.id, request_ids=keep)
        )
        for rid in list(self.batch.request_ids):
            if rid not in keep:
                req = self.requests.pop(rid)
                self._release(req)
                self.done[rid] = req
        self.batch = resp.batch if resp.batch.request_ids else None

    def _absorb(self, resp) -> None:
        for gen in resp.generations:
            req = self.requests[gen.request_id]
            req.generated.extend(gen.tokens.ids)
            req.generations.append(gen)
            if gen.HasField("generated_text"):
                req.finished = gen.generated_text
                self._release(self.requests.pop(gen.request_id))
                self.done[gen.request_id] = req
        self.batch = resp.batch if resp.HasField("batch") else None

    def run_to_completion(self, max_steps: int = 1000) -> None:
        steps = 0
        while self.batch is not None:
            self.decode()
            steps += 1
            assert steps < max_steps


def engine_call(shard) -> Call:
    """`call` that goes through convert + engine in-process (no gRPC)."""
    from shard.server import convert

    def call(method: str, request):
        engine = shard.engine
        if method == "Prefill":
            return convert.prefill_to_proto(engine.prefill(*convert.prefill_from_proto(request)))
        if method == "Decode":
            return convert.decode_to_proto(engine.decode(*convert.decode_from_proto(request)))
        if method == "FilterBatch":
            ref = engine.filter_batch(request.batch_id, list(request.request_ids))
            return pb.FilterBatchResponse(batch=convert.cached_batch_to_proto(ref))
        if method == "ClearCache":
            engine.clear_cache(request.id if request.HasField("id") else None)
            return pb.ClearCacheResponse()
        raise ValueError(method)

    return call
