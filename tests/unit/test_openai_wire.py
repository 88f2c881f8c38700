"""OpenAI JSON -> `GenerateRequest`, and the one-sequence text stream with stop strings, in-process."""

from __future__ import annotations

from typing import Any

import pytest

from beamsplit.server.openai_response import TextStream, first_stop
from beamsplit.server.openai_wire import (
    OpenAIRequestError,
    openai_param,
    parse_chat_request,
    parse_completion_request,
)
from beamsplit.v1 import common_pb2
from engine.chat_template import ChatTemplate
from engine.tokenizer import ByteTokenizer


def parse(**fields: Any) -> Any:
    return parse_completion_request({"model": "tiny", "prompt": "hi", **fields}, "tiny")


def test_defaults_follow_openai() -> None:
    parsed = parse()
    sampling = parsed.request.sampling
    assert parsed.request.text == "hi"
    assert not parsed.is_beam_search and parsed.num_choices == 1
    assert sampling.temperature == 1.0  # OpenAI samples when temperature is absent
    assert not sampling.HasField("beam_width") and not sampling.HasField("max_new_tokens")


def test_beam_search_fields() -> None:
    parsed = parse(
        use_beam_search=True, n=2, best_of=4, max_tokens=9, length_penalty=0.5, early_stopping="never"
    )
    sampling = parsed.request.sampling
    assert parsed.is_beam_search and parsed.num_choices == 2
    assert (sampling.beam_width, sampling.max_new_tokens, sampling.length_penalty) == (4, 9, 0.5)
    assert sampling.early_stopping == common_pb2.EARLY_STOPPING_NEVER
    assert sampling.temperature == 0.0
    assert parse(n=3, use_beam_search=True).request.sampling.beam_width == 3
    assert parse(best_of=3, temperature=0).is_beam_search  # best_of > 1 at temperature 0 is beams


def test_stop_strings_reach_the_engine_with_beams_too() -> None:
    parsed = parse(stop="\n", max_tokens=9)
    assert parsed.stop == ("\n",) and list(parsed.request.sampling.stop_strings) == ["\n"]
    parsed = parse(use_beam_search=True, n=2, stop=["Q:", "\n\n"])
    assert parsed.is_beam_search and list(parsed.request.sampling.stop_strings) == ["Q:", "\n\n"]
    assert openai_param("sampling.stop_strings[0] must be a string of 1 to 128 characters", parsed) == "stop"


def test_token_ids_and_stop_token_id() -> None:
    parsed = parse(prompt=[[5, 6, 7]], stop_token_ids=[42], seed=3, top_p=0.5, top_k=4)
    assert list(parsed.request.token_ids.token_ids) == [5, 6, 7]
    sampling = parsed.request.sampling
    assert (sampling.eos_token_id, sampling.seed, sampling.top_p, sampling.top_k) == (42, 3, 0.5, 4)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": True}, "n"),
        ({"n": 2**40, "use_beam_search": True}, "n"),
        ({"n": 2}, "n"),
        ({"best_of": 2}, "best_of"),  # sampling: best_of > 1 needs temperature 0 or use_beam_search
        ({"best_of": 0, "use_beam_search": True}, "best_of"),
        ({"prompt": ["a", 3]}, "prompt"),
        ({"prompt": ["a"] * 65}, "prompt"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"stop": ["a"] * 5}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": "1"}, "stop_token_ids"),
        ({"echo": True, "stream": True}, "echo"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 1.5}, "logprobs"),
        ({"logit_bias": {"1": 2}}, "logit_bias"),
        ({"stream_options": []}, "stream_options"),
        ({"model": "other"}, "model"),
        ({"temperature": 10**400}, "temperature"),
    ],
)
def test_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIRequestError) as raised:
        parse(**fields)
    assert raised.value.param == param
    assert param in raised.value.message


def test_scoring_fields_map_to_sampling() -> None:
    parsed = parse(prompt=["ab", [1, 2, 3]], echo=True, logprobs=2, max_tokens=0, temperature=0)
    assert [request.WhichOneof("prompt") for request in parsed.all_requests] == ["text", "token_ids"]
    assert list(parsed.all_requests[1].token_ids.token_ids) == [1, 2, 3]
    for request in parsed.all_requests:
        sampling = request.sampling
        assert sampling.logprobs == 2 and sampling.prompt_logprobs == 2
        assert sampling.max_new_tokens == 1  # max_tokens 0 runs one token, which the front drops
    assert parsed.echo and parsed.num_logprobs == 2 and parsed.drops_generated
    plain = parse(logprobs=0, max_tokens=3)
    assert plain.request.sampling.logprobs == 0 and not plain.request.sampling.HasField("prompt_logprobs")
    assert not plain.drops_generated and not plain.echo and len(plain.all_requests) == 1
    unscored = parse(echo=True)
    assert not unscored.request.sampling.HasField("logprobs") and unscored.num_logprobs is None


def test_streamed_logprobs_map_like_unstreamed_ones() -> None:
    """Generated tokens' log-probs stream (each chunk its tokens'); echo and batches do not."""
    streamed = parse(logprobs=2, stream=True)
    assert streamed.is_stream and streamed.request.sampling.logprobs == 2 and streamed.num_logprobs == 2
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "stream": True,
    }
    chat = parse_chat_request({**body, "top_logprobs": 1}, "tiny", TemplatedTokenizer())
    assert chat.is_stream and chat.request.sampling.logprobs == 1
    for fields, param in (({"echo": True, "logprobs": 1}, "echo"), ({"prompt": ["a", "b"]}, "prompt")):
        with pytest.raises(OpenAIRequestError) as raised:
            parse(stream=True, **fields)
        assert raised.value.param == param


def test_chat_logprobs_take_top_logprobs() -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    parsed = parse_chat_request({**body, "top_logprobs": 3}, "tiny", TemplatedTokenizer())
    assert parsed.request.sampling.logprobs == 3 and parsed.num_logprobs == 3
    for extra, param in (({"top_logprobs": 21}, "top_logprobs"), ({"logprobs": 1}, "logprobs")):
        with pytest.raises(OpenAIRequestError) as raised:
            parse_chat_request({**body, **extra}, "tiny", TemplatedTokenizer())
        assert raised.value.param == param
    with pytest.raises(OpenAIRequestError) as raised:
        parse_chat_request({**body, "logprobs": False, "top_logprobs": 2}, "tiny", TemplatedTokenizer())
    assert raised.value.param == "top_logprobs"


def test_nulls_are_absent_fields() -> None:
    parsed = parse(n=None, stop=None, logprobs=None, user=None, suffix=None)
    assert parsed.num_choices == 1 and parsed.stop == ()


def test_validation_messages_map_back_to_openai_fields() -> None:
    parsed = parse(use_beam_search=True, best_of=3)
    assert openai_param("sampling.beam_width must be in [1, 64], got 65", parsed) == "best_of"
    assert openai_param("sampling.max_new_tokens must be >= 1, got 0", parsed) == "max_tokens"
    assert openai_param("prompt.token_ids[2] = 999 is not a token id", parsed) == "prompt"
    assert openai_param("sampling.eos_token_id = 999 is not a token id", parsed) == "stop_token_ids"
    assert openai_param("aggregated server: out of KV blocks", parsed) is None


class TemplatedTokenizer(ByteTokenizer):
    @property
    def chat_template(self) -> ChatTemplate | None:
        source = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
        return ChatTemplate(source)


def test_chat_renders_the_template_into_the_prompt_text() -> None:
    body = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
        ],
        "max_completion_tokens": 5,
    }
    parsed = parse_chat_request(body, "tiny", TemplatedTokenizer())
    assert parsed.request.text == "<system>be brief<user>hi there<assistant>"
    assert parsed.request.sampling.max_new_tokens == 5
    assert parsed.prompt_param == "messages"


def test_chat_without_template_or_with_bad_messages() -> None:
    with pytest.raises(OpenAIRequestError, match="no chat template") as raised:
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}]}, "tiny", ByteTokenizer())
    assert raised.value.param == "messages"
    for messages in ([], [{"role": "user"}], [{"role": "user", "content": [{"type": "image_url"}]}]):
        with pytest.raises(OpenAIRequestError) as raised:
            parse_chat_request({"messages": messages}, "tiny", TemplatedTokenizer())
        assert raised.value.param == "messages"


def test_text_stream_holds_back_a_possible_stop_string() -> None:
    stream = TextStream(ByteTokenizer(), stop=["END"])
    released = [stream.add(list(piece.encode())) for piece in ["abc", "E", "N", "x", "yEN", "D tail"]]
    assert released == ["abc", "", "", "ENx", "y", ""]
    assert stream.is_stopped
    assert stream.finish("abcENxyEND tail") == ""


def test_text_stream_waits_for_a_whole_character_and_ends_with_the_final_text() -> None:
    stream = TextStream(ByteTokenizer(), stop=[])
    euro = "€".encode()
    assert stream.add([*b"a", euro[0]]) == ""
    assert stream.add(list(euro[1:])) == "a€"
    assert stream.finish("a€b") == "b"
    assert first_stop("a€b", ["€", "b"]) == 1
