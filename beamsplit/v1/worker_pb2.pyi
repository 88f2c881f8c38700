from beamsplit.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "attempt", "prompt_token_ids", "num_candidates", "salt", "lease_s", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    attempt: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_candidates: int
    salt: bytes
    lease_s: float
    prompt_logprobs: int
    def __init__(self, request_id: _Optional[str] = ..., attempt: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., num_candidates: _Optional[int] = ..., salt: _Optional[bytes] = ..., lease_s: _Optional[float] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class PageLayout(_message.Message):
    __slots__ = ("region", "tokens_per_block", "page_bytes", "dtype", "model")
    REGION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    region: str
    tokens_per_block: int
    page_bytes: int
    dtype: str
    model: str
    def __init__(self, region: _Optional[str] = ..., tokens_per_block: _Optional[int] = ..., page_bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class Handoff(_message.Message):
    __slots__ = ("request_id", "transfer_id", "ucx_address", "context_address", "layout", "page_ids", "prompt_len", "candidate_ids", "candidate_logprobs", "secret", "lease_deadline_unix_ms", "reused_tokens", "attempt", "recurrent_state", "num_tokens_before_hybrid_pruning", "candidate_model_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_IDS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RECURRENT_STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_BEFORE_HYBRID_PRUNING_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_MODEL_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    ucx_address: str
    context_address: str
    layout: PageLayout
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_len: int
    candidate_ids: _containers.RepeatedScalarFieldContainer[int]
    candidate_logprobs: _containers.RepeatedScalarFieldContainer[float]
    secret: str
    lease_deadline_unix_ms: int
    reused_tokens: int
    attempt: int
    recurrent_state: bytes
    num_tokens_before_hybrid_pruning: int
    candidate_model_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., ucx_address: _Optional[str] = ..., context_address: _Optional[str] = ..., layout: _Optional[_Union[PageLayout, _Mapping]] = ..., page_ids: _Optional[_Iterable[int]] = ..., prompt_len: _Optional[int] = ..., candidate_ids: _Optional[_Iterable[int]] = ..., candidate_logprobs: _Optional[_Iterable[float]] = ..., secret: _Optional[str] = ..., lease_deadline_unix_ms: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., attempt: _Optional[int] = ..., recurrent_state: _Optional[bytes] = ..., num_tokens_before_hybrid_pruning: _Optional[int] = ..., candidate_model_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("handoff", "prefill_ms", "prompt_logprobs")
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    handoff: Handoff
    prefill_ms: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, handoff: _Optional[_Union[Handoff, _Mapping]] = ..., prefill_ms: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("transfer_id", "reason")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: str
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("transfer_id", "extend_s")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    EXTEND_S_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    extend_s: float
    def __init__(self, transfer_id: _Optional[str] = ..., extend_s: _Optional[float] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("alive", "lease_deadline_unix_ms")
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    alive: bool
    lease_deadline_unix_ms: int
    def __init__(self, alive: _Optional[bool] = ..., lease_deadline_unix_ms: _Optional[int] = ...) -> None: ...

class GenerationRequest(_message.Message):
    __slots__ = ("handoff", "prompt_token_ids", "sampling", "salt")
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    handoff: Handoff
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingOptions
    salt: bytes
    def __init__(self, handoff: _Optional[_Union[Handoff, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingOptions, _Mapping]] = ..., salt: _Optional[bytes] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...
