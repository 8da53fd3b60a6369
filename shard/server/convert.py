"""The one place where shard protobuf messages become domain dataclasses and back."""

from __future__ import annotations

from tokenwire.shard.v1 import shard_pb2 as pb

from shard.engine.contracts import (
    BatchSpec,
    BlockGrant,
    CachedBatchRef,
    Generation,
    ImageSpec,
    RequestSpec,
    StepResult,
    StepTimings,
    TokenList,
)
from shard.engine.grammar import GrammarSpec
from shard.engine.sampling import SamplingParams
from shard.engine.stopping import StopReason
from shard.lora import AdapterFacts, AdapterSource
from shard.runner.warmup import WarmupResult, WarmupSpec
from shard.server.loader import RankInfo

FINISH_REASONS = {
    StopReason.LENGTH: pb.FINISH_REASON_LENGTH,
    StopReason.EOS_TOKEN: pb.FINISH_REASON_EOS_TOKEN,
    StopReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
}


# ---- proto -> domain --------------------------------------------------------------------------


def sampling_from_proto(m: pb.SamplingParameters) -> SamplingParams:
    return SamplingParams(
        do_sample=m.do_sample,
        temperature=m.temperature,
        top_k=m.top_k,
        top_p=m.top_p,
        typical_p=m.typical_p,
        repetition_penalty=m.repetition_penalty,
        frequency_penalty=m.frequency_penalty,
        watermark=m.watermark,
        seed=m.seed,
    )


def request_from_proto(m: pb.Request) -> RequestSpec:
    return RequestSpec(
        id=m.id,
        input_ids=list(m.input_ids),
        cache_len=m.cache_len,
        chunk_len=m.chunk_len,
        blocks=list(m.blocks),
        generated_len=m.generated_len,
        sampling=sampling_from_proto(m.sampling),
        max_new_tokens=m.stopping.max_new_tokens,
        stop_sequences=list(m.stopping.stop_sequences),
        ignore_eos_token=m.stopping.ignore_eos_token,
        prefill_logprobs=m.prefill_logprobs,
        top_n_tokens=m.top_n_tokens,
        adapter_id=m.adapter_id,
        grammar=(
            GrammarSpec(kind=m.grammar.kind, source=m.grammar.source)
            if m.HasField("grammar")
            else None
        ),
        ids_only=m.ids_only,
        images=tuple(
            ImageSpec(i.content_hash, i.offset, i.length, tuple(i.shape), i.pixel_values)
            for i in m.images
        ),
    )


def cached_batch_from_proto(m: pb.CachedBatch) -> CachedBatchRef:
    return CachedBatchRef(id=m.id, request_ids=list(m.request_ids))


def grants_from_proto(grants) -> list[BlockGrant]:
    return [BlockGrant(request_id=g.request_id, blocks=list(g.blocks)) for g in grants]


def drafts_from_proto(drafts) -> dict[int, list[int]] | None:
    """{request id: draft tokens} (speculative decoding); None when the step has none."""
    if not drafts:
        return None
    return {d.request_id: list(d.tokens) for d in drafts if d.tokens} or None


def prefill_from_proto(
    m: pb.PrefillRequest,
) -> tuple[BatchSpec, CachedBatchRef | None, list[BlockGrant], dict[int, list[int]] | None]:
    batch = BatchSpec(id=m.batch.id, requests=[request_from_proto(r) for r in m.batch.requests])
    cached = cached_batch_from_proto(m.cached_batch) if m.HasField("cached_batch") else None
    return batch, cached, grants_from_proto(m.block_grants), drafts_from_proto(m.drafts)


def decode_from_proto(
    m: pb.DecodeRequest,
) -> tuple[list[CachedBatchRef], list[BlockGrant], dict[int, list[int]] | None]:
    return (
        [cached_batch_from_proto(b) for b in m.batches],
        grants_from_proto(m.block_grants),
        drafts_from_proto(m.drafts),
    )


def warmup_from_proto(m: pb.WarmupRequest) -> WarmupSpec:
    return WarmupSpec(
        max_input_tokens=m.max_input_tokens,
        max_total_tokens=m.max_total_tokens,
        max_batch_prefill_tokens=m.max_batch_prefill_tokens,
        max_batch_size=m.max_batch_size,
        max_batch_total_tokens=(
            m.max_batch_total_tokens if m.HasField("max_batch_total_tokens") else None
        ),
        speculate_tokens=m.speculate_tokens,
        speculate_max_batch_size=m.speculate_max_batch_size,
    )


# ---- domain -> proto --------------------------------------------------------------------------


def tokens_to_proto(t: TokenList) -> pb.Tokens:
    return pb.Tokens(ids=t.ids, logprobs=t.logprobs, texts=t.texts, is_special=t.is_special)


def _fill_tokens(m: pb.Tokens, t: TokenList) -> None:
    m.SetInParent()  # present even when empty, as a constructed submessage would be
    m.ids.extend(t.ids)
    m.logprobs.extend(t.logprobs)
    m.texts.extend(t.texts)
    m.is_special.extend(t.is_special)


def _fill_generation(m: pb.Generation, g: Generation) -> None:
    """Writes g into m in place: a step answers hundreds of generations, and filling messages
    that the response already owns is ~2.5x cheaper with upb than building each one and copying
    it in."""
    m.request_id = g.request_id
    _fill_tokens(m.tokens, g.tokens)
    for t in g.top_tokens:
        _fill_tokens(m.top_tokens.add(), t)
    if g.prefill_tokens is not None:
        _fill_tokens(m.prefill_tokens, g.prefill_tokens)
    if g.finished is not None:
        f = g.finished
        gt = m.generated_text
        gt.SetInParent()
        gt.text = f.text
        gt.generated_tokens = f.generated_tokens
        gt.finish_reason = FINISH_REASONS[f.finish_reason]
        if f.seed is not None:
            gt.seed = f.seed


def generation_to_proto(g: Generation) -> pb.Generation:
    m = pb.Generation()
    _fill_generation(m, g)
    return m


def cached_batch_to_proto(b: CachedBatchRef) -> pb.CachedBatch:
    return pb.CachedBatch(id=b.id, request_ids=b.request_ids)


def timings_to_proto(t: StepTimings) -> pb.Timings:
    return pb.Timings(
        prepare_ns=t.prepare_ns, forward_ns=t.forward_ns, decode_ns=t.decode_ns, total_ns=t.total_ns
    )


def _fill_step(m: pb.PrefillResponse | pb.DecodeResponse, r: StepResult, packed: bool = False):
    generations = m.generations
    if packed:  # plain generations (one token, nothing else) as arrays: no message per request
        rids: list[int] = []
        ids: list[int] = []
        lps: list[float] = []
        texts: list[str] = []
        special: list[bool] = []
        for g in r.generations:
            t = g.tokens
            if (len(t.ids) != 1 or g.top_tokens or g.prefill_tokens is not None
                    or g.finished is not None):
                _fill_generation(generations.add(), g)
                continue
            rids.append(g.request_id)
            ids.append(t.ids[0])
            lps.append(t.logprobs[0])
            texts.append(t.texts[0])
            special.append(t.is_special[0])
        if rids:
            pk = m.packed
            pk.request_ids.extend(rids)
            pk.ids.extend(ids)
            pk.logprobs.extend(lps)
            pk.texts.extend(texts)
            pk.is_special.extend(special)
    else:
        for g in r.generations:
            _fill_generation(generations.add(), g)
    m.timings.CopyFrom(timings_to_proto(r.timings))
    if r.expert_load is not None:
        m.expert_load.tokens_per_expert.extend(r.expert_load.tokens_per_expert)
        m.expert_load.steps = r.expert_load.steps
    if r.batch is not None:
        m.batch.CopyFrom(cached_batch_to_proto(r.batch))
    return m


def prefill_to_proto(r: StepResult, packed: bool = False) -> pb.PrefillResponse:
    """packed: the request's packed_generations (plain generations go to `packed`)."""
    return _fill_step(pb.PrefillResponse(), r, packed)


def decode_to_proto(r: StepResult, packed: bool = False) -> pb.DecodeResponse:
    return _fill_step(pb.DecodeResponse(), r, packed)


def warmup_to_proto(r: WarmupResult) -> pb.WarmupResponse:
    return pb.WarmupResponse(
        num_blocks=r.num_blocks,
        block_size=r.block_size,
        max_supported_total_tokens=r.max_supported_total_tokens,
        warmup_ns=r.warmup_ns,
    )


def info_to_proto(i: RankInfo, adapters: list[AdapterFacts]) -> pb.InfoResponse:
    return pb.InfoResponse(
        dtype=i.dtype,
        device_type=i.device_type,
        block_size=i.block_size,
        max_position_embeddings=i.max_position_embeddings,
        eos_token_ids=i.eos_token_ids,
        model_type=i.model_type,
        vocab_size=i.vocab_size,
        world_size=i.world_size,
        sliding_window=i.sliding_window,
        attention_backend=i.attention_backend,
        model_sha=i.model_sha,
        model_impl=i.model_impl,
        cuda_graphs=i.cuda_graphs,
        model_id=i.model_id,
        max_loras=i.max_loras,
        max_lora_rank=i.max_lora_rank,
        adapters=[adapter_to_proto(a) for a in adapters],
    )


def adapter_source_from_proto(m: pb.LoadAdapterRequest) -> AdapterSource:
    return AdapterSource(m.name, m.path, m.revision if m.HasField("revision") else None)


def adapter_to_proto(a: AdapterFacts) -> pb.AdapterInfo:
    return pb.AdapterInfo(name=a.name, source=a.source, rank=a.rank, alpha=a.alpha,
                          target_modules=list(a.target_modules))
