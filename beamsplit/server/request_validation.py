"""Up-front validation of a client's `GenerateRequest`, shared by the coordinator and the
aggregated server so both refuse exactly the same requests with exactly the same messages.

Every error names the offending field (`prompt.token_ids[3]`, `sampling.beam_width`, ...): the
server answers INVALID_ARGUMENT with the message as is.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import grpc

from beamsplit.v1 import common_pb2, coordinator_pb2
from beamsplit.wire import ServiceError
from engine.config import SamplingParams
from engine.tokenizer import Tokenizer

DEFAULT_MAX_NEW_TOKENS_LIMIT = 4096
EARLY_STOPPING_FROM_PROTO: Mapping[int, bool | str] = MappingProxyType(
    {
        common_pb2.EARLY_STOPPING_FALSE: False,
        common_pb2.EARLY_STOPPING_TRUE: True,
        common_pb2.EARLY_STOPPING_NEVER: "never",
    }
)
EARLY_STOPPING_TO_PROTO: Mapping[bool | str, Any] = MappingProxyType(
    {value: key for key, value in EARLY_STOPPING_FROM_PROTO.items()}
)


class RequestValidationError(ValueError):
    """A client mistake; the message starts with the field name."""


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int  # prompt plus generated tokens
    eos_token_id: int | None
    max_new_tokens_limit: int = DEFAULT_MAX_NEW_TOKENS_LIMIT


@dataclass(frozen=True)
class ValidatedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    salt: bytes


def validate_generate_request(
    request: coordinator_pb2.GenerateRequest, limits: ModelLimits, tokenizer: Tokenizer
) -> ValidatedRequest:
    prompt_ids = _prompt_ids(request, limits, tokenizer)
    params = sampling_params_from_proto(request.sampling if request.HasField("sampling") else None, limits)
    if len(prompt_ids) + params.max_new_tokens > limits.max_model_len:
        raise RequestValidationError(
            f"prompt is too long: {len(prompt_ids)} prompt tokens + sampling.max_new_tokens "
            f"{params.max_new_tokens} exceed the model's {limits.max_model_len} positions"
        )
    return ValidatedRequest(prompt_ids=prompt_ids, params=params, salt=bytes(request.salt))


def accept_generate_request(
    request: coordinator_pb2.GenerateRequest, limits: ModelLimits, tokenizer: Tokenizer
) -> tuple[ValidatedRequest, str, str]:
    """What a service starts a Generate call with: the validated request (a refusal raises
    INVALID_ARGUMENT), the client's request id (one made up when it sent none) and an id unique
    to this call, which the service uses downstream because a client may reuse its ids."""
    try:
        validated = validate_generate_request(request, limits, tokenizer)
    except RequestValidationError as error:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from error
    request_id = request.request_id or uuid.uuid4().hex
    return validated, request_id, f"{request_id}-{uuid.uuid4().hex[:8]}"


def _prompt_ids(
    request: coordinator_pb2.GenerateRequest, limits: ModelLimits, tokenizer: Tokenizer
) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise RequestValidationError("prompt is missing: set prompt.text or prompt.token_ids")
    if kind == "text":
        if not request.text:
            raise RequestValidationError("prompt.text is empty")
        prompt_ids = tokenizer.encode(request.text)
        if not prompt_ids:
            raise RequestValidationError("prompt.text encodes to no tokens")
        return prompt_ids
    prompt_ids = list(request.token_ids.token_ids)
    if not prompt_ids:
        raise RequestValidationError("prompt.token_ids is empty")
    for index, token_id in enumerate(prompt_ids):
        if not 0 <= token_id < limits.vocab_size:
            raise RequestValidationError(
                f"prompt.token_ids[{index}] = {token_id} is not a token id (vocabulary is [0, {limits.vocab_size}))"
            )
    return prompt_ids


def sampling_params_from_proto(
    options: common_pb2.SamplingOptions | None, limits: ModelLimits
) -> SamplingParams:
    """Engine defaults for unset fields; errors are prefixed `sampling.`."""
    if options is None:
        options = common_pb2.SamplingOptions()
    values: dict[str, object] = {
        "early_stopping": EARLY_STOPPING_FROM_PROTO.get(options.early_stopping, options.early_stopping),
        "temperature": options.temperature,
        "top_k": options.top_k,
        "ignore_eos": options.ignore_eos,
        "stop_strings": tuple(options.stop_strings),
    }
    for name in (
        "beam_width", "max_new_tokens", "length_penalty", "eos_token_id", "top_p", "seed", "logprobs",
        "prompt_logprobs",
    ):  # fmt: skip
        if options.HasField(name):
            values[name] = getattr(options, name)
    try:
        params = SamplingParams(**values)  # type: ignore[arg-type]
    except ValueError as error:
        raise RequestValidationError(f"sampling.{error}") from error
    if params.max_new_tokens > limits.max_new_tokens_limit:
        raise RequestValidationError(
            f"sampling.max_new_tokens must be <= {limits.max_new_tokens_limit}, got {params.max_new_tokens}"
        )
    if params.eos_token_id is not None and params.eos_token_id >= limits.vocab_size:
        raise RequestValidationError(
            f"sampling.eos_token_id = {params.eos_token_id} is not a token id (vocabulary is [0, {limits.vocab_size}))"
        )
    if params.top_k > limits.vocab_size:
        raise RequestValidationError(f"sampling.top_k must be <= {limits.vocab_size}, got {params.top_k}")
    return params


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingOptions:
    options = common_pb2.SamplingOptions(
        beam_width=params.beam_width,
        max_new_tokens=params.max_new_tokens,
        length_penalty=params.length_penalty,
        early_stopping=EARLY_STOPPING_TO_PROTO[params.early_stopping],
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        ignore_eos=params.ignore_eos,
        stop_strings=params.stop_strings,
    )
    if params.eos_token_id is not None:
        options.eos_token_id = params.eos_token_id
    if params.seed is not None:
        options.seed = params.seed
    if params.logprobs is not None:
        options.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        options.prompt_logprobs = params.prompt_logprobs
    return options
