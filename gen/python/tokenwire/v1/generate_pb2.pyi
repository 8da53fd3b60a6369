from google.api import annotations_pb2 as _annotations_pb2
from google.api import httpbody_pb2 as _httpbody_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("inputs", "parameters", "input_chunks")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    INPUT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    inputs: str
    parameters: GenerateParameters
    input_chunks: _containers.RepeatedCompositeFieldContainer[InputChunk]
    def __init__(self, inputs: _Optional[str] = ..., parameters: _Optional[_Union[GenerateParameters, _Mapping]] = ..., input_chunks: _Optional[_Iterable[_Union[InputChunk, _Mapping]]] = ...) -> None: ...

class InputChunk(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: ImagePart
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[ImagePart, _Mapping]] = ...) -> None: ...

class ImagePart(_message.Message):
    __slots__ = ("data", "url")
    DATA_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    url: str
    def __init__(self, data: _Optional[bytes] = ..., url: _Optional[str] = ...) -> None: ...

class GenerateParameters(_message.Message):
    __slots__ = ("best_of", "temperature", "repetition_penalty", "frequency_penalty", "top_k", "top_p", "typical_p", "do_sample", "max_new_tokens", "return_full_text", "stop", "truncate", "watermark", "details", "decoder_input_details", "seed", "top_n_tokens", "grammar", "adapter_id", "coalesce_tokens")
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_FULL_TEXT_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    DECODER_INPUT_DETAILS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    COALESCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    best_of: int
    temperature: float
    repetition_penalty: float
    frequency_penalty: float
    top_k: int
    top_p: float
    typical_p: float
    do_sample: bool
    max_new_tokens: int
    return_full_text: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    truncate: int
    watermark: bool
    details: bool
    decoder_input_details: bool
    seed: int
    top_n_tokens: int
    grammar: Grammar
    adapter_id: str
    coalesce_tokens: bool
    def __init__(self, best_of: _Optional[int] = ..., temperature: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., do_sample: _Optional[bool] = ..., max_new_tokens: _Optional[int] = ..., return_full_text: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., truncate: _Optional[int] = ..., watermark: _Optional[bool] = ..., details: _Optional[bool] = ..., decoder_input_details: _Optional[bool] = ..., seed: _Optional[int] = ..., top_n_tokens: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., adapter_id: _Optional[str] = ..., coalesce_tokens: _Optional[bool] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("type", "value")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    type: str
    value: _struct_pb2.Value
    def __init__(self, type: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "text", "logprob", "special")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    logprob: float
    special: bool
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., special: _Optional[bool] = ...) -> None: ...

class PrefillToken(_message.Message):
    __slots__ = ("id", "text", "logprob")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    logprob: float
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class TopTokens(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    def __init__(self, tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ...) -> None: ...

class BestOfSequence(_message.Message):
    __slots__ = ("generated_text", "finish_reason", "generated_tokens", "seed", "prefill", "tokens", "top_tokens", "accepted_tokens_per_step")
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    generated_text: str
    finish_reason: str
    generated_tokens: int
    seed: int
    prefill: _containers.RepeatedCompositeFieldContainer[PrefillToken]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    top_tokens: _containers.RepeatedCompositeFieldContainer[TopTokens]
    accepted_tokens_per_step: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, generated_text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., prefill: _Optional[_Iterable[_Union[PrefillToken, _Mapping]]] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., top_tokens: _Optional[_Iterable[_Union[TopTokens, _Mapping]]] = ..., accepted_tokens_per_step: _Optional[_Iterable[int]] = ...) -> None: ...

class Details(_message.Message):
    __slots__ = ("finish_reason", "generated_tokens", "seed", "prefill", "tokens", "top_tokens", "best_of_sequences", "accepted_tokens_per_step")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    generated_tokens: int
    seed: int
    prefill: _containers.RepeatedCompositeFieldContainer[PrefillToken]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    top_tokens: _containers.RepeatedCompositeFieldContainer[TopTokens]
    best_of_sequences: _containers.RepeatedCompositeFieldContainer[BestOfSequence]
    accepted_tokens_per_step: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, finish_reason: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., prefill: _Optional[_Iterable[_Union[PrefillToken, _Mapping]]] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., top_tokens: _Optional[_Iterable[_Union[TopTokens, _Mapping]]] = ..., best_of_sequences: _Optional[_Iterable[_Union[BestOfSequence, _Mapping]]] = ..., accepted_tokens_per_step: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("generated_text", "details")
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    generated_text: str
    details: Details
    def __init__(self, generated_text: _Optional[str] = ..., details: _Optional[_Union[Details, _Mapping]] = ...) -> None: ...

class StreamDetails(_message.Message):
    __slots__ = ("finish_reason", "generated_tokens", "seed", "input_length", "accepted_tokens_per_step")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INPUT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    generated_tokens: int
    seed: int
    input_length: int
    accepted_tokens_per_step: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, finish_reason: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., input_length: _Optional[int] = ..., accepted_tokens_per_step: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("index", "token", "top_tokens", "generated_text", "details", "error", "error_type", "coalesced")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    COALESCED_FIELD_NUMBER: _ClassVar[int]
    index: int
    token: Token
    top_tokens: _containers.RepeatedCompositeFieldContainer[Token]
    generated_text: str
    details: StreamDetails
    error: str
    error_type: str
    coalesced: CoalescedTokens
    def __init__(self, index: _Optional[int] = ..., token: _Optional[_Union[Token, _Mapping]] = ..., top_tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., generated_text: _Optional[str] = ..., details: _Optional[_Union[StreamDetails, _Mapping]] = ..., error: _Optional[str] = ..., error_type: _Optional[str] = ..., coalesced: _Optional[_Union[CoalescedTokens, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_id", "model_sha", "model_dtype", "model_device_type", "model_pipeline_tag", "max_concurrent_requests", "max_best_of", "max_stop_sequences", "max_input_tokens", "max_total_tokens", "validation_workers", "max_client_batch_size", "router", "version", "sha", "docker_label", "max_top_n_tokens", "max_batch_total_tokens", "block_size", "num_kv_blocks", "num_shard", "model_impl", "cuda_graphs", "adapters", "max_loras", "max_lora_rank", "speculate")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA_FIELD_NUMBER: _ClassVar[int]
    MODEL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_PIPELINE_TAG_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BEST_OF_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_CLIENT_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA_FIELD_NUMBER: _ClassVar[int]
    DOCKER_LABEL_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARD_FIELD_NUMBER: _ClassVar[int]
    MODEL_IMPL_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_sha: str
    model_dtype: str
    model_device_type: str
    model_pipeline_tag: str
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    validation_workers: int
    max_client_batch_size: int
    router: str
    version: str
    sha: str
    docker_label: str
    max_top_n_tokens: int
    max_batch_total_tokens: int
    block_size: int
    num_kv_blocks: int
    num_shard: int
    model_impl: str
    cuda_graphs: bool
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    max_loras: int
    max_lora_rank: int
    speculate: int
    def __init__(self, model_id: _Optional[str] = ..., model_sha: _Optional[str] = ..., model_dtype: _Optional[str] = ..., model_device_type: _Optional[str] = ..., model_pipeline_tag: _Optional[str] = ..., max_concurrent_requests: _Optional[int] = ..., max_best_of: _Optional[int] = ..., max_stop_sequences: _Optional[int] = ..., max_input_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., validation_workers: _Optional[int] = ..., max_client_batch_size: _Optional[int] = ..., router: _Optional[str] = ..., version: _Optional[str] = ..., sha: _Optional[str] = ..., docker_label: _Optional[str] = ..., max_top_n_tokens: _Optional[int] = ..., max_batch_total_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., num_shard: _Optional[int] = ..., model_impl: _Optional[str] = ..., cuda_graphs: _Optional[bool] = ..., adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., speculate: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("inputs", "add_special_tokens")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    inputs: str
    add_special_tokens: bool
    def __init__(self, inputs: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class SimpleToken(_message.Message):
    __slots__ = ("id", "text", "start", "stop")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    start: int
    stop: int
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[SimpleToken]
    def __init__(self, tokens: _Optional[_Iterable[_Union[SimpleToken, _Mapping]]] = ...) -> None: ...

class AdapterSource(_message.Message):
    __slots__ = ("name", "path", "revision")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    revision: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., revision: _Optional[str] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterSource]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterSource, _Mapping]]] = ...) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("name", "path", "rank", "alpha", "target_modules")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ...) -> None: ...

class CoalescedTokens(_message.Message):
    __slots__ = ("tokens", "top_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    top_tokens: _containers.RepeatedCompositeFieldContainer[TopTokens]
    def __init__(self, tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., top_tokens: _Optional[_Iterable[_Union[TopTokens, _Mapping]]] = ...) -> None: ...
