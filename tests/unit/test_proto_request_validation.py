"""From a client's `GenerateRequest` to engine arguments: defaults, round trips, named errors."""

from __future__ import annotations

import pytest

from beamsplit.server.request_validation import (
    ModelLimits,
    RequestValidationError,
    sampling_params_from_proto,
    sampling_params_to_proto,
    validate_generate_request,
)
from beamsplit.v1 import common_pb2, coordinator_pb2
from engine.config import SamplingParams
from engine.tokenizer import ByteTokenizer

LIMITS = ModelLimits(vocab_size=260, max_model_len=128, eos_token_id=257)


def request(**fields: object) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(**fields)  # type: ignore[arg-type]


def test_unset_sampling_fields_take_the_engine_defaults() -> None:
    assert sampling_params_from_proto(None, LIMITS) == SamplingParams()
    assert sampling_params_from_proto(common_pb2.SamplingOptions(), LIMITS) == SamplingParams()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(beam_width=4, max_new_tokens=7, length_penalty=0.5, early_stopping=True),
        SamplingParams(beam_width=2, early_stopping="never", eos_token_id=3, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=11),
        SamplingParams(beam_width=3, stop_strings=("\n\n", "Q:")),  # reaches the generation worker
    ],
)
def test_sampling_params_round_trip(params: SamplingParams) -> None:
    assert sampling_params_from_proto(sampling_params_to_proto(params), LIMITS) == params


def test_text_prompt_is_tokenized_and_token_ids_pass_through() -> None:
    validated = validate_generate_request(request(text="hi", salt=b"tenant"), LIMITS, ByteTokenizer())
    assert validated.prompt_ids == [104, 105]
    assert validated.salt == b"tenant"
    validated = validate_generate_request(
        request(token_ids=common_pb2.TokenIds(token_ids=[1, 259])), LIMITS, ByteTokenizer()
    )
    assert validated.prompt_ids == [1, 259]


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (request(), "prompt is missing"),
        (request(text=""), "prompt.text is empty"),
        (request(token_ids=common_pb2.TokenIds()), "prompt.token_ids is empty"),
        (request(token_ids=common_pb2.TokenIds(token_ids=[5, 260])), "prompt.token_ids[1] = 260"),
        (request(text="hi", sampling=common_pb2.SamplingOptions(beam_width=-1)), "sampling.beam_width"),
        (
            request(text="hi", sampling=common_pb2.SamplingOptions(max_new_tokens=5000)),
            "sampling.max_new_tokens",
        ),
        (request(text="hi", sampling=common_pb2.SamplingOptions(eos_token_id=999)), "sampling.eos_token_id"),
        (request(text="hi", sampling=common_pb2.SamplingOptions(top_k=261)), "sampling.top_k"),
        (
            request(text="hi", sampling=common_pb2.SamplingOptions(stop_strings=["a", ""])),
            "sampling.stop_strings[1]",
        ),
        (
            request(text="hi", sampling=common_pb2.SamplingOptions(stop_strings=["a"] * 5)),
            "sampling.stop_strings",
        ),
        (
            request(text="hi", sampling=common_pb2.SamplingOptions(stop_strings=["a" * 129])),
            "sampling.stop_strings[0]",
        ),
        (
            request(text="x" * 120, sampling=common_pb2.SamplingOptions(max_new_tokens=9)),
            "prompt is too long",
        ),
    ],
)
def test_errors_start_with_the_field(message: coordinator_pb2.GenerateRequest, field: str) -> None:
    with pytest.raises(RequestValidationError) as raised:
        validate_generate_request(message, LIMITS, ByteTokenizer())
    assert str(raised.value).startswith(field)


def test_a_prompt_that_exactly_fits_is_accepted() -> None:
    message = request(text="x" * 120, sampling=common_pb2.SamplingOptions(max_new_tokens=8))
    assert len(validate_generate_request(message, LIMITS, ByteTokenizer()).prompt_ids) == 120
