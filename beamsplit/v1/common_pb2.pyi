from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EarlyStopping(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EARLY_STOPPING_FALSE: _ClassVar[EarlyStopping]
    EARLY_STOPPING_TRUE: _ClassVar[EarlyStopping]
    EARLY_STOPPING_NEVER: _ClassVar[EarlyStopping]
EARLY_STOPPING_FALSE: EarlyStopping
EARLY_STOPPING_TRUE: EarlyStopping
EARLY_STOPPING_NEVER: EarlyStopping

class SamplingOptions(_message.Message):
    __slots__ = ("beam_width", "max_new_tokens", "length_penalty", "early_stopping", "eos_token_id", "temperature", "top_k", "top_p", "seed", "ignore_eos", "stop_strings", "logprobs", "prompt_logprobs")
    BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    beam_width: int
    max_new_tokens: int
    length_penalty: float
    early_stopping: EarlyStopping
    eos_token_id: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    ignore_eos: bool
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    logprobs: int
    prompt_logprobs: int
    def __init__(self, beam_width: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[_Union[EarlyStopping, str]] = ..., eos_token_id: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_strings: _Optional[_Iterable[str]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("beams", "texts", "parent_indices")
    BEAMS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    PARENT_INDICES_FIELD_NUMBER: _ClassVar[int]
    beams: _containers.RepeatedCompositeFieldContainer[TokenIds]
    texts: _containers.RepeatedScalarFieldContainer[str]
    parent_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, beams: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., texts: _Optional[_Iterable[str]] = ..., parent_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class Beam(_message.Message):
    __slots__ = ("token_ids", "text", "cumulative_logprob", "score", "finish_reason", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    cumulative_logprob: float
    score: float
    finish_reason: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., cumulative_logprob: _Optional[float] = ..., score: _Optional[float] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class RequestStats(_message.Message):
    __slots__ = ("prompt_tokens", "context_reused_tokens", "generation_reused_tokens", "transferred_blocks", "transferred_bytes", "transfer_ms", "ttft_ms", "e2e_ms", "context_worker", "generation_worker", "engine")
    class EngineEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    E2E_MS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WORKER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_WORKER_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    context_reused_tokens: int
    generation_reused_tokens: int
    transferred_blocks: int
    transferred_bytes: int
    transfer_ms: float
    ttft_ms: float
    e2e_ms: float
    context_worker: str
    generation_worker: str
    engine: _containers.ScalarMap[str, float]
    def __init__(self, prompt_tokens: _Optional[int] = ..., context_reused_tokens: _Optional[int] = ..., generation_reused_tokens: _Optional[int] = ..., transferred_blocks: _Optional[int] = ..., transferred_bytes: _Optional[int] = ..., transfer_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., e2e_ms: _Optional[float] = ..., context_worker: _Optional[str] = ..., generation_worker: _Optional[str] = ..., engine: _Optional[_Mapping[str, float]] = ...) -> None: ...

class FinalResult(_message.Message):
    __slots__ = ("beams", "stats", "prompt_logprobs")
    BEAMS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    beams: _containers.RepeatedCompositeFieldContainer[Beam]
    stats: RequestStats
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, beams: _Optional[_Iterable[_Union[Beam, _Mapping]]] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "delta", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    delta: Delta
    final: FinalResult
    def __init__(self, request_id: _Optional[str] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ..., final: _Optional[_Union[FinalResult, _Mapping]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_requests", "num_blocks_in_use", "num_blocks_total", "num_blocks_cached", "num_waiting_requests", "prompt_tokens", "reused_tokens", "transfer_blocks", "transfer_bytes", "transfer_failures", "transfers_in_flight", "lease_expiries", "beam_tail_copies", "requests_ok", "requests_failed", "requests_refused", "requests_cancelled", "kv_groups")
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    BEAM_TAIL_COPIES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_OK_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    num_requests: int
    num_blocks_in_use: int
    num_blocks_total: int
    num_blocks_cached: int
    num_waiting_requests: int
    prompt_tokens: int
    reused_tokens: int
    transfer_blocks: int
    transfer_bytes: int
    transfer_failures: int
    transfers_in_flight: int
    lease_expiries: int
    beam_tail_copies: int
    requests_ok: int
    requests_failed: int
    requests_refused: int
    requests_cancelled: int
    kv_groups: _containers.RepeatedCompositeFieldContainer[KVGroupLoad]
    def __init__(self, num_requests: _Optional[int] = ..., num_blocks_in_use: _Optional[int] = ..., num_blocks_total: _Optional[int] = ..., num_blocks_cached: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., transfer_blocks: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., transfer_failures: _Optional[int] = ..., transfers_in_flight: _Optional[int] = ..., lease_expiries: _Optional[int] = ..., beam_tail_copies: _Optional[int] = ..., requests_ok: _Optional[int] = ..., requests_failed: _Optional[int] = ..., requests_refused: _Optional[int] = ..., requests_cancelled: _Optional[int] = ..., kv_groups: _Optional[_Iterable[_Union[KVGroupLoad, _Mapping]]] = ...) -> None: ...

class KVGroupLoad(_message.Message):
    __slots__ = ("name", "num_blocks_in_use", "num_blocks_total")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_blocks_in_use: int
    num_blocks_total: int
    def __init__(self, name: _Optional[str] = ..., num_blocks_in_use: _Optional[int] = ..., num_blocks_total: _Optional[int] = ...) -> None: ...

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model", "dtype", "tokens_per_block", "vocab_size", "eos_token_id", "max_model_len", "num_blocks", "page_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    tokens_per_block: int
    vocab_size: int
    eos_token_id: int
    max_model_len: int
    num_blocks: int
    page_bytes: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., tokens_per_block: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_blocks: _Optional[int] = ..., page_bytes: _Optional[int] = ...) -> None: ...
