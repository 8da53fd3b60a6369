"""Proto <-> domain conversion for the internal shard protocol (the router side's one module).

The scheduler's typed step contracts (service.scheduler.contracts) become PrefillRequest /
DecodeRequest here, and the shard's answers become StepOutput; Info and Warmup become the engine's
backend facts (service.engine.backend). Finish reasons map in one place.
"""

from __future__ import annotations

from tokenwire.shard.v1 import shard_pb2 as pb

from service.engine.adapters import AdapterInfo, AdapterSource
from service.engine.backend import ShardDescription, WarmupBudgets, WarmupInfo
from service.engine.contracts import FinishReason, TokenInfo, ValidatedRequest
from service.scheduler.contracts import FinishInfo, GenerationOut, StepOutput, StepPlan

# The one map of the shard's finish reasons.
FINISH_REASONS: dict[int, FinishReason] = {
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_EOS_TOKEN: FinishReason.EOS_TOKEN,
    pb.FINISH_REASON_STOP_SEQUENCE: FinishReason.STOP_SEQUENCE,
}
FINISH_REASONS_TO_PROTO: dict[FinishReason, int] = {v: k for k, v in FINISH_REASONS.items()}


def warmup_request(b: WarmupBudgets) -> pb.WarmupRequest:
    req = pb.WarmupRequest(
        max_input_tokens=b.max_input_tokens,
        max_total_tokens=b.max_total_tokens,
        max_batch_prefill_tokens=b.max_batch_prefill_tokens,
        max_batch_size=b.max_batch_size,
    )
    if b.max_batch_total_tokens is not None:
        req.max_batch_total_tokens = b.max_batch_total_tokens
    if b.speculate_tokens:
        req.speculate_tokens = b.speculate_tokens
        req.speculate_max_batch_size = b.speculate_max_batch_size
    return req


def warmup_info(r: pb.WarmupResponse) -> WarmupInfo:
    return WarmupInfo(r.num_blocks, r.block_size, r.max_supported_total_tokens, r.warmup_ns)


def shard_description(r: pb.InfoResponse) -> ShardDescription:
    return ShardDescription(
        model_id=r.model_id,
        model_type=r.model_type,
        dtype=r.dtype,
        device_type=r.device_type,
        block_size=r.block_size,
        max_position_embeddings=r.max_position_embeddings,
        eos_token_ids=tuple(r.eos_token_ids),
        vocab_size=r.vocab_size,
        world_size=r.world_size,
        sliding_window=r.sliding_window if r.HasField("sliding_window") else None,
        attention_backend=r.attention_backend,
        model_impl=r.model_impl,
        cuda_graphs=r.cuda_graphs,
        model_sha=r.model_sha if r.HasField("model_sha") else None,
        max_loras=r.max_loras,
        max_lora_rank=r.max_lora_rank,
        adapters=tuple(adapter_info(a) for a in r.adapters),
    )


def adapter_info(m: pb.AdapterInfo) -> AdapterInfo:
    return AdapterInfo(m.name, m.source, m.rank, m.alpha, tuple(m.target_modules))


def load_adapter_request(source: AdapterSource) -> pb.LoadAdapterRequest:
    req = pb.LoadAdapterRequest(name=source.name, path=source.path)
    if source.revision is not None:
        req.revision = source.revision
    return req


def sampling_proto(req: ValidatedRequest) -> pb.SamplingParameters:
    s = req.sampling
    return pb.SamplingParameters(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        typical_p=s.typical_p,
        do_sample=s.do_sample,
        seed=s.seed,
        repetition_penalty=s.repetition_penalty,
        frequency_penalty=s.frequency_penalty,
        watermark=s.watermark,
    )


def stopping_proto(req: ValidatedRequest) -> pb.StoppingParameters:
    s = req.stopping
    return pb.StoppingParameters(
        max_new_tokens=s.max_new_tokens,
        stop_sequences=list(s.stop_sequences),
        ignore_eos_token=s.ignore_eos_token,
    )


def _cached_batch(batch_id: int, ids: list[int]) -> pb.CachedBatch:
    return pb.CachedBatch(id=batch_id, request_ids=ids)


def _grants(plan: StepPlan) -> list[pb.BlockGrant]:
    return [pb.BlockGrant(request_id=rid, blocks=blocks) for rid, blocks in plan.grants]


def _drafts(plan: StepPlan) -> list[pb.Draft]:
    return [pb.Draft(request_id=rid, tokens=tokens) for rid, tokens in plan.drafts]


def _images(req: ValidatedRequest, start: int, end: int) -> list[pb.ImageInput]:
    """All the request's images (their places set M-RoPE positions, Qwen2-VL), with pixel
    values only for those whose placeholders overlap the chunk's positions [start, end)."""
    return [
        pb.ImageInput(content_hash=i.content_hash, offset=i.offset, length=i.length,
                      shape=i.shape,
                      pixel_values=i.pixel_values if i.offset < end and start < i.offset + i.length
                      else b"")
        for i in req.images
    ]


def prefill_request(
    plan: StepPlan, new_batch_id: int, cached_id: int | None, cached_ids: list[int]
) -> pb.PrefillRequest:
    """Chunks of the plan as a Batch, fused with the decode of the running (cached) batch."""
    requests = []
    for c in plan.chunks:
        vreq: ValidatedRequest = c.payload  # type: ignore[assignment]
        requests.append(
            pb.Request(
                id=c.seq_id,
                input_ids=c.input_ids,
                cache_len=c.cache_len,
                chunk_len=c.chunk_len,
                blocks=c.blocks,
                generated_len=c.generated_len,
                sampling=sampling_proto(vreq),
                stopping=stopping_proto(vreq),
                prefill_logprobs=c.prefill_logprobs,
                top_n_tokens=vreq.top_n_tokens,
                adapter_id=vreq.adapter,
                grammar=(
                    pb.OutputGrammar(kind=vreq.grammar.kind, source=vreq.grammar.source)
                    if vreq.grammar is not None
                    else None
                ),
                traceparent=vreq.traceparent or "",
                ids_only=vreq.ids_only,
                images=_images(vreq, c.cache_len, c.cache_len + c.chunk_len),
            )
        )
    req = pb.PrefillRequest(
        batch=pb.Batch(id=new_batch_id, requests=requests), packed_generations=True
    )
    if cached_id is not None:
        req.cached_batch.CopyFrom(_cached_batch(cached_id, cached_ids))
    if plan.grants:
        req.block_grants.extend(_grants(plan))
    if plan.drafts:
        req.drafts.extend(_drafts(plan))
    return req


def decode_request(plan: StepPlan, cached_id: int, cached_ids: list[int]) -> pb.DecodeRequest:
    req = pb.DecodeRequest(
        batches=[_cached_batch(cached_id, cached_ids)], block_grants=_grants(plan),
        packed_generations=True,
    )
    if plan.drafts:
        req.drafts.extend(_drafts(plan))
    return req


def filter_request(batch_id: int, keep_ids: list[int]) -> pb.FilterBatchRequest:
    return pb.FilterBatchRequest(batch_id=batch_id, request_ids=keep_ids)


def clear_cache_request(batch_id: int | None) -> pb.ClearCacheRequest:
    """Forget batch `batch_id`, or every batch when None."""
    return pb.ClearCacheRequest() if batch_id is None else pb.ClearCacheRequest(id=batch_id)


def _tokens(t: pb.Tokens) -> tuple[TokenInfo, ...]:
    n = len(t.ids)
    lps = t.logprobs
    texts = t.texts
    specials = t.is_special
    return tuple(
        TokenInfo(
            t.ids[i],
            texts[i] if i < len(texts) else "",
            lps[i] if i < len(lps) else float("nan"),
            specials[i] if i < len(specials) else False,
        )
        for i in range(n)
    )


def step_output(resp: pb.PrefillResponse | pb.DecodeResponse) -> StepOutput:
    """The shard's answer as the scheduler and the engine consume it. A Generation carries one
    token, or several when the step verified drafts (speculative decoding); fast path for one."""
    gens: list[GenerationOut] = []
    append = gens.append
    packed = resp.packed
    if packed.request_ids:  # plain generations: one token each, as arrays
        texts = list(packed.texts)
        lps = list(packed.logprobs)
        special = list(packed.is_special)
        for i, (rid, tid) in enumerate(zip(packed.request_ids, packed.ids)):
            append(GenerationOut(rid, TokenInfo(tid, texts[i], lps[i], special[i])))
    for g in resp.generations:
        t = g.tokens
        token = TokenInfo(t.ids[0], t.texts[0], t.logprobs[0], t.is_special[0])
        out = GenerationOut(g.request_id, token)
        if g.top_tokens:
            out.top_tokens = _tokens(g.top_tokens[0])
        if len(t.ids) > 1:
            tops = g.top_tokens
            out.more = tuple(
                (
                    TokenInfo(t.ids[i], t.texts[i], t.logprobs[i], t.is_special[i]),
                    _tokens(tops[i]) if i < len(tops) else (),
                )
                for i in range(1, len(t.ids))
            )
        if g.HasField("prefill_tokens"):
            out.prefill = _tokens(g.prefill_tokens)
        if g.HasField("generated_text"):
            gt = g.generated_text
            out.finish = FinishInfo(
                reason=FINISH_REASONS[gt.finish_reason],
                text=gt.text,
                generated_tokens=gt.generated_tokens,
                seed=gt.seed if gt.HasField("seed") else None,
            )
        append(out)
    load = tuple(resp.expert_load.tokens_per_expert) if resp.HasField("expert_load") else None
    if resp.HasField("batch"):
        return StepOutput(
            gens, resp.batch.id, list(resp.batch.request_ids), resp.timings.forward_ns, load
        )
    return StepOutput(gens, None, [], resp.timings.forward_ns, load)
