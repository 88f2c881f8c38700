from beamsplit.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _common_pb2.TokenIds
    sampling: _common_pb2.SamplingOptions
    salt: bytes
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingOptions, _Mapping]] = ..., salt: _Optional[bytes] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("role", "requests_in_flight", "requests_ok", "requests_failed", "workers", "requests_refused", "requests_cancelled")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_OK_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    role: str
    requests_in_flight: int
    requests_ok: int
    requests_failed: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    requests_refused: int
    requests_cancelled: int
    def __init__(self, role: _Optional[str] = ..., requests_in_flight: _Optional[int] = ..., requests_ok: _Optional[int] = ..., requests_failed: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., requests_refused: _Optional[int] = ..., requests_cancelled: _Optional[int] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("address", "role", "healthy", "detail", "info", "load")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: str
    healthy: bool
    detail: str
    info: _common_pb2.WorkerInfo
    load: _common_pb2.WorkerLoad
    def __init__(self, address: _Optional[str] = ..., role: _Optional[str] = ..., healthy: _Optional[bool] = ..., detail: _Optional[str] = ..., info: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ...) -> None: ...
