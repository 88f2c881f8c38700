"""A pulled request's first token leaves before the next forward pass, not with its result."""

from __future__ import annotations

from unittest import mock

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams


def make_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float64", cache=CacheConfig(tokens_per_block=16, num_blocks=64)))


def test_first_token_is_sent_without_a_forward_pass() -> None:
    prompt = [(5 + 7 * index) % 250 for index in range(40)]
    params = SamplingParams(beam_width=2, max_new_tokens=4, ignore_eos=True)
    context, generation = make_engine(), make_engine()
    prefilled = context.prefill("r", prompt, params.num_candidates)
    reservation = generation.reserve_prompt("r", prompt, params=params)
    generation.kv_pool.data[reservation.missing_block_ids] = context.kv_pool.data[prefilled.block_ids]
    context.release_prefill("r")
    generation.add_prefilled_request(
        reservation, prompt, params, prefilled.candidate_ids, prefilled.candidate_logprobs
    )
    assert generation.has_ready_outputs  # the loop hands it out without a turn on shared cores
    with mock.patch.object(generation.runner, "forward", wraps=generation.runner.forward) as forward:
        first = generation.step()
        assert not generation.has_ready_outputs
        assert forward.call_count == 0
        assert [output.request_id for output in first] == ["r"]
        assert not first[0].finished
        assert [len(tokens) for tokens in first[0].new_token_ids] == [1, 1]  # one token per live beam
        assert first[0].new_token_ids == [[token] for token in prefilled.candidate_ids[:2]]
        second = generation.step()
        assert forward.call_count == 1
        assert [len(tokens) for tokens in second[0].new_token_ids] == [1, 1]
    while generation.has_unfinished():
        generation.step()
    generation.check_integrity()
    assert generation.num_blocks_in_use() == 0
