"""Conversions between engine records and `beamsplit.v1` messages, and the error every plain
service class raises so that its servicer can answer with a precise gRPC status.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from beamsplit.v1 import common_pb2
from engine.tokenizer import Tokenizer
from engine.types import Beam, RequestOutput, TokenLogprob

# ReleaseRequest.reason from a generation worker whose pull completed: the context worker counts
# the pages it served on this release when it comes before the offer's own completion.
PULLED_REASON = "pulled"


class ServiceError(Exception):
    """A failure with the status the client should see; the message says what and where."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def delta_to_proto(output: RequestOutput, tokenizer: Tokenizer) -> common_pb2.Delta:
    return common_pb2.Delta(
        beams=[common_pb2.TokenIds(token_ids=list(token_ids)) for token_ids in output.new_token_ids],
        texts=[tokenizer.decode(list(token_ids)) for token_ids in output.new_token_ids],
        parent_indices=list(output.parent_indices),
        logprobs=token_logprobs_to_proto(output.new_logprobs),
    )


def apply_delta(beams: list[list[int]], delta: common_pb2.Delta) -> list[list[int]]:
    """The live beams after `delta`, rebuilt from the live beams before it."""
    parents = list(delta.parent_indices) or list(range(len(delta.beams)))
    return [
        (list(beams[parent]) if parent < len(beams) else []) + list(tokens.token_ids)
        for parent, tokens in zip(parents, delta.beams, strict=False)
    ]


def beams_to_proto(beams: Sequence[Beam], tokenizer: Tokenizer) -> list[common_pb2.Beam]:
    return [
        common_pb2.Beam(
            token_ids=list(beam.token_ids),
            text=tokenizer.decode(list(beam.token_ids)),
            cumulative_logprob=beam.cumulative_logprob,
            score=beam.score,
            finish_reason=beam.finish_reason,
            logprobs=token_logprobs_to_proto(beam.logprobs or []),
        )
        for beam in beams
    ]


def token_logprobs_to_proto(records: Sequence[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [
        common_pb2.TokenLogprob(
            token_id=record.token_id,
            logprob=record.logprob,
            top_token_ids=[token_id for token_id, _ in record.top],
            top_logprobs=[logprob for _, logprob in record.top],
        )
        for record in records
    ]


def token_logprobs_from_proto(records: Sequence[common_pb2.TokenLogprob]) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            record.token_id,
            record.logprob,
            tuple(zip(record.top_token_ids, record.top_logprobs, strict=True)),
        )
        for record in records
    ]


def beams_from_proto(beams: Sequence[common_pb2.Beam]) -> list[Beam]:
    return [
        Beam(
            token_ids=list(beam.token_ids),
            cumulative_logprob=beam.cumulative_logprob,
            score=beam.score,
            finish_reason=beam.finish_reason,
            logprobs=token_logprobs_from_proto(beam.logprobs) if beam.logprobs else None,
        )
        for beam in beams
    ]


def engine_stats_to_map(stats: dict[str, float | int]) -> dict[str, float]:
    return {name: float(value) for name, value in stats.items() if isinstance(value, (int, float))}


def stats_to_dict(stats: common_pb2.RequestStats) -> dict[str, object]:
    """The flat `stats` object of the JSON output (same keys the issue lists, then engine counters)."""
    result: dict[str, object] = {
        "prompt_tokens": stats.prompt_tokens,
        "context_reused_tokens": stats.context_reused_tokens,
        "generation_reused_tokens": stats.generation_reused_tokens,
        "transferred_blocks": stats.transferred_blocks,
        "transferred_bytes": stats.transferred_bytes,
        "transfer_ms": round(stats.transfer_ms, 3),
        "ttft_ms": round(stats.ttft_ms, 3),
        "e2e_ms": round(stats.e2e_ms, 3),
        "context_worker": stats.context_worker,
        "generation_worker": stats.generation_worker,
    }
    for name, value in sorted(stats.engine.items()):
        result.setdefault(name, int(value) if float(value).is_integer() else value)
    return result
