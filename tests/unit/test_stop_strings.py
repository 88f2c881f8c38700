"""Stop strings end sequences inside the engine (engine/stop_strings.py), on the embedded `tiny` model.

Checked: the tail-decoding matcher fires at exactly the token a whole-text search first finds
the string at (multi-byte characters and special tokens included) and decodes a bounded tail;
greedy, sampling and beam search stop at that step with no further forward pass for the request,
its blocks freed by that step (check_integrity after every step), the kept tokens counted; a
stop completed by the first token, aggregated and on the generation side (pulled pages).
Beam search against transformers is tests/unit/test_stop_strings_parity.py.
"""

from __future__ import annotations

import random
from unittest import mock

import pytest

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.stop_strings import TAIL_MARGIN_CHARS, StopStringMatcher
from engine.tokenizer import ByteTokenizer
from engine.types import RequestOutput

PROMPT = [(11 + 13 * index) % 256 for index in range(37)]
MAX_NEW_TOKENS = 40


def make_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float64", cache=CacheConfig(tokens_per_block=16, num_blocks=64)))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return make_engine()


def first_stop_index(tokenizer: ByteTokenizer, token_ids: list[int], stops: list[str]) -> int | None:
    """The definition, by whole-text decodes: the first token after which the text holds a stop."""
    for end in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:end])
        if any(stop in text for stop in stops):
            return end - 1
    return None


class CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        self.decoded_lens: list[int] = []

    def decode(self, token_ids: list[int]) -> str:
        self.decoded_lens.append(len(token_ids))
        return super().decode(token_ids)


def test_matcher_fires_where_the_whole_text_first_holds_the_string() -> None:
    tokenizer = ByteTokenizer()
    rng = random.Random(7)
    alphabet = list("ab \n") + ["é", "€", "😀"]  # 2-, 3- and 4-byte characters
    num_found = 0
    for trial in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        token_ids = tokenizer.encode(text)
        for _ in range(rng.randint(0, 3)):  # special tokens decode to nothing
            token_ids.insert(rng.randint(0, len(token_ids)), ByteTokenizer.EOS_TOKEN_ID)
        stops = [rng.choice(["ab", "\n\n", "é€", "😀b", " a ", "b€😀"]) for _ in range(rng.randint(1, 3))]
        matcher = StopStringMatcher(tokenizer, stops)
        found = next((end for end in range(len(token_ids)) if matcher.is_stopped(token_ids[: end + 1])), None)
        assert found == first_stop_index(tokenizer, token_ids, stops), f"trial {trial}: {text!r} {stops}"
        num_found += found is not None
    assert num_found > 50  # the trials exercise matches, not only misses


def test_matcher_decodes_a_bounded_tail() -> None:
    tokenizer = CountingTokenizer()
    matcher = StopStringMatcher(tokenizer, ["xyz"])
    token_ids = tokenizer.encode("a" * 500)
    assert not matcher.is_stopped(token_ids)
    # The tail before the newest token holds len("xyz") + margin characters: one byte each here.
    assert max(tokenizer.decoded_lens) == len("xyz") + TAIL_MARGIN_CHARS + 1
    assert matcher.is_stopped(token_ids + tokenizer.encode("xyz"))


def run_steps(engine: LLMEngine, request_id: str) -> tuple[RequestOutput, list[int]]:
    """Steps until `request_id` finishes, check_integrity after each; blocks in use after each step."""
    blocks: list[int] = []
    while True:
        outputs = engine.step()
        engine.check_integrity()
        blocks.append(engine.num_blocks_in_use())
        for output in outputs:
            if output.request_id == request_id and output.finished:
                return output, blocks


def greedy_tokens(engine: LLMEngine, params: SamplingParams) -> list[int]:
    output = engine.generate(PROMPT, params)
    assert engine.num_blocks_in_use() == 0
    return output.beams[0].token_ids


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampling"])
def test_one_sequence_stops_at_the_step_its_text_completes_the_string(
    engine: LLMEngine, temperature: float
) -> None:
    base = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, temperature=temperature, seed=3)
    full = greedy_tokens(engine, base)
    assert len(full) == MAX_NEW_TOKENS
    text = engine.tokenizer.decode(full)
    stop = text[9:11]
    stop_index = first_stop_index(ByteTokenizer(), full, [stop])
    assert stop_index is not None and stop_index < MAX_NEW_TOKENS // 2

    params = SamplingParams(
        max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, temperature=temperature, seed=3, stop_strings=(stop,)
    )
    engine.add_request("stopped", PROMPT, params)
    engine.add_request("free", PROMPT, base)  # same prompt, no stop: runs on in the same batch
    with mock.patch.object(engine.runner, "forward", wraps=engine.runner.forward) as forward:
        output, blocks = run_steps(engine, "stopped")
        forwards_until_stop = forward.call_count
    beam = output.beams[0]
    assert beam.token_ids == full[: stop_index + 1]
    assert beam.finish_reason == "stop"
    assert stop in engine.tokenizer.decode(beam.token_ids)
    assert stop not in engine.tokenizer.decode(beam.token_ids[:-1])
    # One forward for the prompt (its logits give token 0), then one per further kept token.
    assert forwards_until_stop == stop_index + 1
    assert output.stats["decode_steps"] == len(beam.token_ids)
    # The step that finished it freed its blocks: only the other request's remain, then none.
    assert [request.request_id for request in engine.scheduler.running] == ["free"]
    assert blocks[-1] == engine.scheduler.running[0].num_blocks_held()
    free, _ = run_steps(engine, "free")
    assert free.beams[0].token_ids == full and free.beams[0].finish_reason == "length"
    assert engine.num_blocks_in_use() == 0


def test_beam_search_ends_beams_on_the_string(engine: LLMEngine) -> None:
    width = 3
    base = SamplingParams(beam_width=width, max_new_tokens=12, ignore_eos=True)
    unstopped = engine.generate(PROMPT, base)
    text = engine.tokenizer.decode(unstopped.beams[0].token_ids)
    stop = text[3:5]
    params = SamplingParams(beam_width=width, max_new_tokens=12, ignore_eos=True, stop_strings=(stop,))
    engine.add_request("beams", PROMPT, params)
    output, blocks = run_steps(engine, "beams")
    assert blocks[-1] == 0
    tokenizer = ByteTokenizer()
    num_stopped = 0
    for beam in output.beams:
        index = first_stop_index(tokenizer, beam.token_ids, [stop])
        if beam.finish_reason == "stop":
            # It ends at the token completing the string, as a beam ends at its eos.
            assert index == len(beam.token_ids) - 1
            num_stopped += 1
        else:
            assert index is None and len(beam.token_ids) == 12
        assert beam.score == pytest.approx(beam.cumulative_logprob / len(beam.token_ids), rel=1e-6)
    assert num_stopped >= 1


def test_first_token_can_complete_the_string_aggregated_and_pulled() -> None:
    aggregated, context, generation = (make_engine() for _ in range(3))
    first = greedy_tokens(aggregated, SamplingParams(max_new_tokens=1, ignore_eos=True))
    stop = aggregated.tokenizer.decode(first)
    assert stop, "the tiny model's first token is a byte with text"
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, stop_strings=(stop,))
    aggregated.add_request("a", PROMPT, params)
    output, blocks = run_steps(aggregated, "a")
    assert output.beams[0].token_ids == first and output.beams[0].finish_reason == "stop"
    assert blocks == [0] and output.stats["decode_steps"] == 1

    prefilled = context.prefill("g", PROMPT, params.num_candidates)
    reservation = generation.reserve_prompt("g", PROMPT, params=params)
    generation.kv_pool.data[reservation.missing_block_ids] = context.kv_pool.data[prefilled.block_ids]
    context.release_prefill("g")
    generation.add_prefilled_request(
        reservation, PROMPT, params, prefilled.candidate_ids, prefilled.candidate_logprobs
    )
    generation.check_integrity()
    assert generation.num_blocks_in_use() == 0  # finished before any forward pass
    with mock.patch.object(generation.runner, "forward") as forward:
        pulled, _ = run_steps(generation, "g")
        assert forward.call_count == 0
    assert pulled.beams == output.beams
    assert not generation.has_unfinished()


@pytest.mark.parametrize(
    ("stop_strings", "message"),
    [
        (("",), "stop_strings[0]"),
        (("a", "b", "c", "d", "e"), "at most 4"),
        (("x" * 129,), "stop_strings[0]"),
        (["a"], "tuple"),
    ],
)
def test_bad_stop_strings_are_refused_naming_the_field(stop_strings: object, message: str) -> None:
    with pytest.raises(ValueError, match="stop_strings") as raised:
        SamplingParams(stop_strings=stop_strings)  # type: ignore[arg-type]
    assert message in str(raised.value)
