"""Checks of the internal worker messages, so a bad peer (or a raw client) gets INVALID_ARGUMENT
naming the field instead of an engine error deep inside a step.

The coordinator validates what clients send; these checks cover what reaches a worker directly:
token ids outside the vocabulary, a handoff whose pages or candidates cannot be right, an empty
id in Release, Heartbeat or Cancel. An id that is well formed but unknown is not an error there:
those calls are idempotent and answer `released/alive/cancelled = false`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from beamsplit.server.request_validation import RequestValidationError
from beamsplit.v1 import worker_pb2


def check_id(value: str, field: str) -> None:
    if not value:
        raise RequestValidationError(f"{field} is empty")


def check_token_ids(token_ids: Sequence[int], vocab_size: int, field: str) -> None:
    if not token_ids:
        raise RequestValidationError(f"{field} is empty")
    for index, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise RequestValidationError(
                f"{field}[{index}] = {token_id} is not a token id (vocabulary is [0, {vocab_size}))"
            )


def check_num_candidates(num_candidates: int, vocab_size: int) -> None:
    if not 1 <= num_candidates <= vocab_size:
        raise RequestValidationError(f"num_candidates must be in [1, {vocab_size}], got {num_candidates}")


def check_handoff(handoff: worker_pb2.Handoff, vocab_size: int) -> None:
    """What the generation side can check alone; the holder refuses pages outside its region."""
    check_id(handoff.request_id, "handoff.request_id")
    check_id(handoff.transfer_id, "handoff.transfer_id")
    for index, page_id in enumerate(handoff.page_ids):
        if page_id < 0:
            raise RequestValidationError(f"handoff.page_ids[{index}] = {page_id} is not a page id")
    if len(set(handoff.page_ids)) != len(handoff.page_ids):
        raise RequestValidationError("handoff.page_ids names a page twice")
    check_token_ids(handoff.candidate_ids, vocab_size, "handoff.candidate_ids")
    if len(handoff.candidate_logprobs) != len(handoff.candidate_ids):
        raise RequestValidationError(
            f"handoff.candidate_logprobs has {len(handoff.candidate_logprobs)} entries for "
            f"{len(handoff.candidate_ids)} candidate_ids"
        )
    if len(handoff.candidate_model_logprobs) not in (0, len(handoff.candidate_ids)):
        raise RequestValidationError(
            f"handoff.candidate_model_logprobs has {len(handoff.candidate_model_logprobs)} entries for "
            f"{len(handoff.candidate_ids)} candidate_ids"
        )
    for name in ("candidate_logprobs", "candidate_model_logprobs"):
        for index, logprob in enumerate(getattr(handoff, name)):
            if math.isnan(logprob) or logprob > 0:
                raise RequestValidationError(f"handoff.{name}[{index}] = {logprob} is not a log-probability")
