from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS_TOKEN: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("dtype", "device_type", "block_size", "max_position_embeddings", "eos_token_ids", "model_type", "vocab_size", "world_size", "sliding_window", "attention_backend", "model_sha", "model_id", "model_impl", "cuda_graphs", "max_loras", "max_lora_rank", "adapters")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_IMPL_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    device_type: str
    block_size: int
    max_position_embeddings: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    model_type: str
    vocab_size: int
    world_size: int
    sliding_window: int
    attention_backend: str
    model_sha: str
    model_id: str
    model_impl: str
    cuda_graphs: bool
    max_loras: int
    max_lora_rank: int
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, dtype: _Optional[str] = ..., device_type: _Optional[str] = ..., block_size: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., model_type: _Optional[str] = ..., vocab_size: _Optional[int] = ..., world_size: _Optional[int] = ..., sliding_window: _Optional[int] = ..., attention_backend: _Optional[str] = ..., model_sha: _Optional[str] = ..., model_id: _Optional[str] = ..., model_impl: _Optional[str] = ..., cuda_graphs: _Optional[bool] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

class ServiceDiscoveryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceDiscoveryResponse(_message.Message):
    __slots__ = ("urls",)
    URLS_FIELD_NUMBER: _ClassVar[int]
    urls: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, urls: _Optional[_Iterable[str]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WarmupRequest(_message.Message):
    __slots__ = ("max_input_tokens", "max_total_tokens", "max_batch_prefill_tokens", "max_batch_size", "max_batch_total_tokens", "speculate_tokens", "speculate_max_batch_size")
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_size: int
    max_batch_total_tokens: int
    speculate_tokens: int
    speculate_max_batch_size: int
    def __init__(self, max_input_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., max_batch_prefill_tokens: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_batch_total_tokens: _Optional[int] = ..., speculate_tokens: _Optional[int] = ..., speculate_max_batch_size: _Optional[int] = ...) -> None: ...

class WarmupResponse(_message.Message):
    __slots__ = ("num_blocks", "block_size", "max_supported_total_tokens", "warmup_ns")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SUPPORTED_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_NS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    max_supported_total_tokens: int
    warmup_ns: int
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_supported_total_tokens: _Optional[int] = ..., warmup_ns: _Optional[int] = ...) -> None: ...

class SamplingParameters(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "typical_p", "do_sample", "seed", "repetition_penalty", "frequency_penalty", "watermark")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    do_sample: bool
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    watermark: bool
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., do_sample: _Optional[bool] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., watermark: _Optional[bool] = ...) -> None: ...

class StoppingParameters(_message.Message):
    __slots__ = ("max_new_tokens", "stop_sequences", "ignore_eos_token")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop_sequences: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos_token: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop_sequences: _Optional[_Iterable[str]] = ..., ignore_eos_token: _Optional[bool] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("id", "input_ids", "cache_len", "chunk_len", "blocks", "generated_len", "sampling", "stopping", "prefill_logprobs", "top_n_tokens", "grammar", "adapter_id", "traceparent", "ids_only", "images")
    ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_LEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    IDS_ONLY_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    id: int
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_len: int
    chunk_len: int
    blocks: _containers.RepeatedScalarFieldContainer[int]
    generated_len: int
    sampling: SamplingParameters
    stopping: StoppingParameters
    prefill_logprobs: bool
    top_n_tokens: int
    grammar: OutputGrammar
    adapter_id: str
    traceparent: str
    ids_only: bool
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    def __init__(self, id: _Optional[int] = ..., input_ids: _Optional[_Iterable[int]] = ..., cache_len: _Optional[int] = ..., chunk_len: _Optional[int] = ..., blocks: _Optional[_Iterable[int]] = ..., generated_len: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParameters, _Mapping]] = ..., stopping: _Optional[_Union[StoppingParameters, _Mapping]] = ..., prefill_logprobs: _Optional[bool] = ..., top_n_tokens: _Optional[int] = ..., grammar: _Optional[_Union[OutputGrammar, _Mapping]] = ..., adapter_id: _Optional[str] = ..., traceparent: _Optional[str] = ..., ids_only: _Optional[bool] = ..., images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ...) -> None: ...

class ImageInput(_message.Message):
    __slots__ = ("content_hash", "offset", "length", "shape", "pixel_values")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    content_hash: bytes
    offset: int
    length: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    pixel_values: bytes
    def __init__(self, content_hash: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., pixel_values: _Optional[bytes] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("id", "requests")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    id: int
    requests: _containers.RepeatedCompositeFieldContainer[Request]
    def __init__(self, id: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[Request, _Mapping]]] = ...) -> None: ...

class CachedBatch(_message.Message):
    __slots__ = ("id", "request_ids")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    id: int
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[int] = ..., request_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockGrant(_message.Message):
    __slots__ = ("request_id", "blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[int] = ..., blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("batch", "cached_batch", "block_grants", "drafts", "step_index", "packed_generations")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    CACHED_BATCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_GRANTS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    PACKED_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    cached_batch: CachedBatch
    block_grants: _containers.RepeatedCompositeFieldContainer[BlockGrant]
    drafts: _containers.RepeatedCompositeFieldContainer[Draft]
    step_index: int
    packed_generations: bool
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., cached_batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., block_grants: _Optional[_Iterable[_Union[BlockGrant, _Mapping]]] = ..., drafts: _Optional[_Iterable[_Union[Draft, _Mapping]]] = ..., step_index: _Optional[int] = ..., packed_generations: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("batches", "block_grants", "drafts", "step_index", "packed_generations")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_GRANTS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    PACKED_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[CachedBatch]
    block_grants: _containers.RepeatedCompositeFieldContainer[BlockGrant]
    drafts: _containers.RepeatedCompositeFieldContainer[Draft]
    step_index: int
    packed_generations: bool
    def __init__(self, batches: _Optional[_Iterable[_Union[CachedBatch, _Mapping]]] = ..., block_grants: _Optional[_Iterable[_Union[BlockGrant, _Mapping]]] = ..., drafts: _Optional[_Iterable[_Union[Draft, _Mapping]]] = ..., step_index: _Optional[int] = ..., packed_generations: _Optional[bool] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("ids", "logprobs", "texts", "is_special")
    IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    IS_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    texts: _containers.RepeatedScalarFieldContainer[str]
    is_special: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., texts: _Optional[_Iterable[str]] = ..., is_special: _Optional[_Iterable[bool]] = ...) -> None: ...

class GeneratedText(_message.Message):
    __slots__ = ("text", "generated_tokens", "finish_reason", "seed")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int
    def __init__(self, text: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., seed: _Optional[int] = ...) -> None: ...

class Generation(_message.Message):
    __slots__ = ("request_id", "prefill_tokens", "tokens", "top_tokens", "generated_text")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    prefill_tokens: Tokens
    tokens: Tokens
    top_tokens: _containers.RepeatedCompositeFieldContainer[Tokens]
    generated_text: GeneratedText
    def __init__(self, request_id: _Optional[int] = ..., prefill_tokens: _Optional[_Union[Tokens, _Mapping]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., top_tokens: _Optional[_Iterable[_Union[Tokens, _Mapping]]] = ..., generated_text: _Optional[_Union[GeneratedText, _Mapping]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("prepare_ns", "forward_ns", "decode_ns", "total_ns")
    PREPARE_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    prepare_ns: int
    forward_ns: int
    decode_ns: int
    total_ns: int
    def __init__(self, prepare_ns: _Optional[int] = ..., forward_ns: _Optional[int] = ..., decode_ns: _Optional[int] = ..., total_ns: _Optional[int] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("tokens_per_expert", "steps")
    TOKENS_PER_EXPERT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    tokens_per_expert: _containers.RepeatedScalarFieldContainer[int]
    steps: int
    def __init__(self, tokens_per_expert: _Optional[_Iterable[int]] = ..., steps: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("generations", "batch", "timings", "packed", "expert_load")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    EXPERT_LOAD_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    batch: CachedBatch
    timings: Timings
    packed: PackedTokens
    expert_load: ExpertLoad
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., packed: _Optional[_Union[PackedTokens, _Mapping]] = ..., expert_load: _Optional[_Union[ExpertLoad, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("generations", "batch", "timings", "packed", "expert_load")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    EXPERT_LOAD_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    batch: CachedBatch
    timings: Timings
    packed: PackedTokens
    expert_load: ExpertLoad
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., packed: _Optional[_Union[PackedTokens, _Mapping]] = ..., expert_load: _Optional[_Union[ExpertLoad, _Mapping]] = ...) -> None: ...

class FilterBatchRequest(_message.Message):
    __slots__ = ("batch_id", "request_ids")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_id: _Optional[int] = ..., request_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FilterBatchResponse(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: CachedBatch
    def __init__(self, batch: _Optional[_Union[CachedBatch, _Mapping]] = ...) -> None: ...

class ClearCacheRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: int
    def __init__(self, id: _Optional[int] = ...) -> None: ...

class ClearCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "revision")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    revision: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., revision: _Optional[str] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "source", "rank", "alpha", "target_modules")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: AdapterInfo
    def __init__(self, adapter: _Optional[_Union[AdapterInfo, _Mapping]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Draft(_message.Message):
    __slots__ = ("request_id", "tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class OutputGrammar(_message.Message):
    __slots__ = ("kind", "source")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    source: str
    def __init__(self, kind: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class PackedTokens(_message.Message):
    __slots__ = ("request_ids", "ids", "logprobs", "texts", "is_special")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    IS_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    texts: _containers.RepeatedScalarFieldContainer[str]
    is_special: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, request_ids: _Optional[_Iterable[int]] = ..., ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., texts: _Optional[_Iterable[str]] = ..., is_special: _Optional[_Iterable[bool]] = ...) -> None: ...
