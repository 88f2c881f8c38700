"""Undecodable requests answer INVALID_ARGUMENT, not gRPC's INTERNAL "Exception deserializing request!".

A well-behaved client cannot send invalid UTF-8 in a proto `string` field (its library refuses to
serialize it), but a raw client, another language's library or a corrupted frame can. grpcio
calls the method's `request_deserializer` before any handler code runs and maps its exception to
INTERNAL, which reads as a server bug. This interceptor wraps each method's deserializer so a
failure becomes a marker value, and each behaviour so the marker is refused with
INVALID_ARGUMENT naming the message type and, when it can be found, the field.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message


class UndecodableRequest:
    """What the wrapped deserializer returns instead of raising."""

    def __init__(self, message: str) -> None:
        self.message = message


class DecodeGuardInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler  # unknown method (UNIMPLEMENTED as usual) or a client stream (none here)
        deserialize = handler.request_deserializer
        if handler.response_streaming:
            return handler._replace(
                request_deserializer=_guarded(deserialize), unary_stream=_guard_stream(handler.unary_stream)
            )
        return handler._replace(
            request_deserializer=_guarded(deserialize), unary_unary=_guard_unary(handler.unary_unary)
        )


def _guarded(deserialize: Callable[[bytes], Message]) -> Callable[[bytes], object]:
    def guarded(data: bytes) -> object:
        try:
            return deserialize(data)
        except (DecodeError, ValueError, UnicodeDecodeError) as error:
            return UndecodableRequest(_describe(deserialize, data, error))

    return guarded


def _describe(deserialize: Callable[[bytes], Message], data: bytes, error: Exception) -> str:
    message_class = getattr(deserialize, "__self__", None)
    name = message_class.DESCRIPTOR.full_name if message_class is not None else "the request message"
    field = _bad_string_field(message_class, data) if message_class is not None else None
    if field is not None:
        return f"{field}: not valid UTF-8 (a proto string field must be UTF-8); the {name} was refused"
    return f"request: not a valid {name} ({type(error).__name__}: {error})"


def _bad_string_field(message_class: Any, data: bytes) -> str | None:
    """The top-level string field holding invalid UTF-8, if the wire data is otherwise sound."""
    fields = {field.number: field for field in message_class.DESCRIPTOR.fields}
    position = 0
    try:
        while position < len(data):
            key, position = _varint(data, position)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, position = _varint(data, position)
            elif wire_type == 1:
                position += 8
            elif wire_type == 5:
                position += 4
            elif wire_type == 2:
                length, position = _varint(data, position)
                value = data[position : position + length]
                position += length
                field = fields.get(number)
                if field is not None and field.type == field.TYPE_STRING:
                    try:
                        value.decode("utf-8")
                    except UnicodeDecodeError:
                        oneof = field.containing_oneof
                        return f"{oneof.name}.{field.name}" if oneof is not None else str(field.name)
            else:
                return None
    except IndexError:
        return None
    return None


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7


def _guard_unary(behaviour: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
    def guarded(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, UndecodableRequest):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return behaviour(request, context)

    return guarded


def _guard_stream(behaviour: Callable[[Any, grpc.ServicerContext], Iterator[Any]]) -> Callable[..., Any]:
    def guarded(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        if isinstance(request, UndecodableRequest):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        yield from behaviour(request, context)

    return guarded
