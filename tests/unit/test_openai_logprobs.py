"""The log-prob records -> OpenAI's completions and chat `logprobs` shapes, and echo's choice text."""

from __future__ import annotations

from beamsplit.server.openai_logprobs import chat_logprobs, completion_logprobs
from beamsplit.server.openai_response import final_choices
from beamsplit.server.openai_wire import parse_completion_request
from beamsplit.v1 import common_pb2
from engine.tokenizer import ByteTokenizer


def record(token_id: int, logprob: float, top: list[tuple[int, float]]) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=token_id,
        logprob=logprob,
        top_token_ids=[token for token, _ in top],
        top_logprobs=[value for _, value in top],
    )


def test_completion_shape_with_echo() -> None:
    records = [record(ord("b"), -0.5, [(ord("b"), -0.5)]), record(ord("c"), -2.0, [(ord("x"), -0.25)])]
    body = completion_logprobs(ByteTokenizer(), ord("a"), records)
    assert body == {
        "tokens": ["a", "b", "c"],
        "token_logprobs": [None, -0.5, -2.0],
        # k best, plus the chosen token when it is not among them (OpenAI's up to k + 1)
        "top_logprobs": [None, {"b": -0.5}, {"x": -0.25, "c": -2.0}],
        "text_offset": [0, 1, 2],
    }
    assert completion_logprobs(ByteTokenizer(), None, records, start_offset=4)["text_offset"] == [4, 5]


def test_chat_shape_lists_exactly_k_alternatives() -> None:
    body = chat_logprobs(ByteTokenizer(), [record(ord("c"), -2.0, [(ord("x"), -0.25), (ord("y"), -1.0)])])
    assert body == {
        "content": [
            {
                "token": "c",
                "logprob": -2.0,
                "bytes": [99],
                "top_logprobs": [
                    {"token": "x", "logprob": -0.25, "bytes": [120]},
                    {"token": "y", "logprob": -1.0, "bytes": [121]},
                ],
            }
        ]
    }


def test_echo_with_max_tokens_zero_drops_the_decided_token() -> None:
    parsed = parse_completion_request(
        {"model": "tiny", "prompt": ["ab", [99, 100]], "echo": True, "logprobs": 1, "max_tokens": 0}, "tiny"
    )
    beam = common_pb2.Beam(
        token_ids=[101], text="e", cumulative_logprob=-1.0, finish_reason="length",
        logprobs=[record(101, -1.0, [(101, -1.0)])],
    )  # fmt: skip
    final = common_pb2.FinalResult(beams=[beam], prompt_logprobs=[record(100, -3.0, [(120, -0.5)])])
    choices = final_choices(final, parsed, ByteTokenizer(), prompt_index=1)
    assert [choice.index for choice in choices] == [1]
    choice = choices[0]
    assert choice.text == "cd" and choice.token_ids == [] and choice.finish_reason == "length"
    assert choice.logprobs is not None
    assert choice.logprobs["tokens"] == ["c", "d"]
    assert choice.logprobs["token_logprobs"] == [None, -3.0]
