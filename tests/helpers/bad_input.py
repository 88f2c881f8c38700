"""Issue 11's bad-input list, once per client front, for the `tiny` model (vocabulary 260, 4096
positions, beam width at most 64, max_new_tokens at most 4096).

gRPC cases are wire bytes, so the malformed ones (invalid UTF-8 in a string field, an oversized
message) sit in the same table as the well-formed ones. HTTP cases are raw request bodies.
docs/robustness.md prints the same list with what the client receives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import grpc

from beamsplit.client.grpc_client import build_request
from beamsplit.v1 import common_pb2

TINY_VOCAB = 260
TINY_MAX_POSITIONS = 4096
OVERSIZED_BYTES = 5 * 1024 * 1024  # over the 4 MiB default of --max-message-mb and --http-max-body-mb
NAN = float("nan")


@dataclass(frozen=True)
class GrpcCase:
    name: str
    wire: bytes
    code: grpc.StatusCode
    field: str  # a substring the status message must hold


@dataclass(frozen=True)
class HttpCase:
    name: str
    body: bytes
    status: int
    param: str | None  # the OpenAI error's `param`


def _request(sampling: dict[str, Any] | None = None, **prompt: Any) -> bytes:
    options = common_pb2.SamplingOptions(**sampling) if sampling is not None else None
    return build_request(sampling=options, **prompt).SerializeToString()


def _hi(**sampling: Any) -> bytes:
    return _request(sampling, prompt="hi")


def _string_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field written by hand: what a raw client can send whatever its bytes."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


INVALID = grpc.StatusCode.INVALID_ARGUMENT
GRPC_CASES = [
    GrpcCase("empty text", _request(prompt=""), INVALID, "prompt.text"),
    GrpcCase("empty token ids", _request(token_ids=[]), INVALID, "prompt.token_ids"),
    GrpcCase(
        "prompt too long",
        _request({"max_new_tokens": 16}, token_ids=[1] * (TINY_MAX_POSITIONS - 4)),
        INVALID,
        "prompt is too long",
    ),
    GrpcCase("token id = vocab", _request(token_ids=[1, 2, TINY_VOCAB]), INVALID, "prompt.token_ids[2]"),
    GrpcCase("token id negative", _request(token_ids=[-1]), INVALID, "prompt.token_ids[0]"),
    GrpcCase("token id 2^62", _request(token_ids=[5, 2**62]), INVALID, "prompt.token_ids[1]"),
    GrpcCase("beam width 0", _hi(beam_width=0), INVALID, "sampling.beam_width"),
    GrpcCase("beam width -1", _hi(beam_width=-1), INVALID, "sampling.beam_width"),
    GrpcCase("beam width 65", _hi(beam_width=65), INVALID, "sampling.beam_width"),
    GrpcCase("max_new_tokens 0", _hi(max_new_tokens=0), INVALID, "sampling.max_new_tokens"),
    GrpcCase("max_new_tokens 2^31-1", _hi(max_new_tokens=2**31 - 1), INVALID, "sampling.max_new_tokens"),
    GrpcCase("temperature NaN", _hi(temperature=NAN), INVALID, "sampling.temperature"),
    GrpcCase("temperature -1", _hi(temperature=-1.0), INVALID, "sampling.temperature"),
    GrpcCase("length_penalty 1e300", _hi(length_penalty=1e300), INVALID, "sampling.length_penalty"),
    GrpcCase("top_p 0", _hi(top_p=0.0), INVALID, "sampling.top_p"),
    GrpcCase("top_p 1.5", _hi(top_p=1.5), INVALID, "sampling.top_p"),
    GrpcCase("top_p NaN", _hi(top_p=NAN), INVALID, "sampling.top_p"),
    GrpcCase("invalid UTF-8 text", _string_field(2, b"ab\xff\xfe"), INVALID, "prompt.text"),
    GrpcCase("invalid UTF-8 request_id", _string_field(1, b"\xc3") + _hi(), INVALID, "request_id"),
    GrpcCase("not a protobuf", b"\xff\xff\xff\xff", INVALID, "beamsplit.v1.GenerateRequest"),
    GrpcCase(
        "oversized message",
        _request(prompt="a" * OVERSIZED_BYTES),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "larger than max",
    ),
]


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4, **fields}).encode()


HTTP_CASES = [
    HttpCase("empty prompt", _body(prompt=""), 400, "prompt"),
    HttpCase("empty token ids", _body(prompt=[]), 400, "prompt"),
    HttpCase("prompt too long", _body(prompt=[1] * (TINY_MAX_POSITIONS - 4), max_tokens=16), 400, "prompt"),
    HttpCase("token id = vocab", _body(prompt=[1, 2, TINY_VOCAB]), 400, "prompt"),
    HttpCase("token id negative", _body(prompt=[-1]), 400, "prompt"),
    HttpCase("token id 2^70", _body(prompt=[2**70]), 400, "prompt"),
    HttpCase("n 0", _body(n=0), 400, "n"),
    HttpCase("n -1 (beam width negative)", _body(n=-1, use_beam_search=True), 400, "n"),
    HttpCase("best_of 0 (beam width 0)", _body(best_of=0), 400, "best_of"),
    HttpCase("best_of 65 (beam width > max)", _body(best_of=65, temperature=0), 400, "best_of"),
    HttpCase("max_tokens -1", _body(max_tokens=-1), 400, "max_tokens"),  # 0 scores the prompt only
    HttpCase("max_tokens 2^31-1", _body(max_tokens=2**31 - 1), 400, "max_tokens"),
    HttpCase("temperature NaN", _body(temperature=NAN), 400, "temperature"),
    HttpCase("temperature -1", _body(temperature=-1.0), 400, "temperature"),
    HttpCase("length_penalty 159", _body(length_penalty=159), 400, "length_penalty"),
    HttpCase("top_p 0", _body(top_p=0.0), 400, "top_p"),
    HttpCase("top_p 1.5", _body(top_p=1.5), 400, "top_p"),
    HttpCase("top_p NaN", _body(top_p=NAN), 400, "top_p"),
    HttpCase("body not UTF-8", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None),
    HttpCase("body not JSON", b"{not json", 400, None),
    HttpCase("oversized body", _body(prompt="a" * OVERSIZED_BYTES), 413, None),
]
