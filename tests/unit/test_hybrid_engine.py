"""The embedded `tiny-hybrid` (LFM2 layout) through the engine: the reuse diagnostic in a request's
stats, resumption from a snapshot equal to a fresh run, batch invariance with recurrent states,
and the context/generation handoff of the prompt's final state.

float64, so batching and chunking (different matmul shapes) cannot move a rounding.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from engine import CacheConfig, EngineConfig, LLMEngine, RequestOutput, SamplingParams


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_engine(partial: bool = False, tokens_per_block: int = 32) -> LLMEngine:
    cache = CacheConfig(
        tokens_per_block=tokens_per_block,
        num_blocks=64,
        enable_partial_reuse=partial,
        enable_partial_commit=partial,
    )
    return LLMEngine(EngineConfig(model="tiny-hybrid", dtype="float64", cache=cache, max_num_seqs=16))


def prompt_of(length: int, offset: int) -> list[int]:
    return [(offset + 7 * index) % 250 + 3 for index in range(length)]


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, RequestOutput]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, RequestOutput] = {}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for output in engine.step():
            if output.finished:
                assert output.error is None, output.error
                outputs[output.request_id] = output
        engine.check_integrity()
    assert not engine.has_unfinished()
    assert engine.num_blocks_in_use() == 0
    return outputs


def assert_same(left: RequestOutput, right: RequestOutput) -> None:
    assert [beam.token_ids for beam in left.beams] == [beam.token_ids for beam in right.beams]
    for beam, other in zip(left.beams, right.beams, strict=True):
        assert math.isclose(beam.cumulative_logprob, other.cumulative_logprob, rel_tol=0.0, abs_tol=1e-9)


def test_request_stats_report_the_pages_and_the_snapshot_apart() -> None:
    """Block 32, partial reuse and commit on. 48 vs 32: pages cover 48 of the 52-token lookup, the
    latest snapshot that fits is at 32. 64 vs 64: both agree, on a 69-token lookup."""
    greedy = SamplingParams(max_new_tokens=4, ignore_eos=True)
    engine = make_engine(partial=True)
    first = prompt_of(49, 0)
    second = first[:48] + prompt_of(5, 101)
    third = prompt_of(65, 50)
    fourth = third[:64] + prompt_of(6, 201)
    outputs = run(engine, {"first": (first, greedy)})
    outputs |= run(engine, {"second": (second, greedy)})
    outputs |= run(engine, {"third": (third, greedy)})
    outputs |= run(engine, {"fourth": (fourth, greedy)})
    # Sharing all 49 tokens of the published partial block: its snapshot (49) fits exactly, the
    # block is copied before it is written and the prompt resumes at 49.
    fifth = first + prompt_of(11, 301)
    outputs |= run(engine, {"fifth": (fifth, greedy)})
    stats = outputs["second"].stats
    print("second request stats:", {key: value for key, value in stats.items() if not key.endswith("_s")})
    assert (stats["num_tokens_before_hybrid_pruning"], stats["reused_tokens"]) == (48, 32)
    stats = outputs["fourth"].stats
    assert (stats["num_tokens_before_hybrid_pruning"], stats["reused_tokens"]) == (64, 64)
    stats = outputs["fifth"].stats
    assert (stats["num_tokens_before_hybrid_pruning"], stats["reused_tokens"], stats["copied_blocks"]) == (
        49,
        49,
        1,
    )
    assert engine.counters().hybrid_pruned_tokens == 16

    fresh = run(
        make_engine(partial=True),
        {"second": (second, greedy), "fourth": (fourth, greedy), "fifth": (fifth, greedy)},
    )
    for request_id in ("second", "fourth", "fifth"):
        assert fresh[request_id].stats["reused_tokens"] == 0
        assert_same(outputs[request_id], fresh[request_id])


def test_llama_reports_the_reused_length_as_the_diagnostic() -> None:
    cache = CacheConfig(
        tokens_per_block=32, num_blocks=32, enable_partial_reuse=True, enable_partial_commit=True
    )
    engine = LLMEngine(EngineConfig(model="tiny", cache=cache))
    greedy = SamplingParams(max_new_tokens=2, ignore_eos=True)
    first = prompt_of(49, 0)
    engine.generate(first, greedy)
    stats = engine.generate(first[:48] + prompt_of(5, 101), greedy).stats
    assert stats["num_tokens_before_hybrid_pruning"] == stats["reused_tokens"] == 48
    assert engine.state_pool is None


def test_beams_do_not_depend_on_batch_neighbours() -> None:
    requests = {
        "a": (prompt_of(5, 1), SamplingParams(beam_width=3, max_new_tokens=6)),
        "b": (prompt_of(40, 2), SamplingParams(max_new_tokens=7, ignore_eos=True)),
        "c": (prompt_of(33, 3), SamplingParams(beam_width=4, max_new_tokens=5, ignore_eos=True)),
        "d": (prompt_of(16, 4), SamplingParams(beam_width=2, max_new_tokens=8, length_penalty=0.5)),
    }
    together = run(make_engine(tokens_per_block=16), requests)
    for request_id, request in requests.items():
        alone = run(make_engine(tokens_per_block=16), {request_id: request})
        assert_same(together[request_id], alone[request_id])


@pytest.mark.parametrize("prompt_len", [31, 32])
def test_context_and_generation_engines_equal_the_aggregated_one(prompt_len: int) -> None:
    """The context engine's PrefillResult carries the final state; installed on the generation
    engine before the beams expand, it gives the aggregated beams."""
    prompt = prompt_of(prompt_len, 9)
    params = SamplingParams(beam_width=3, max_new_tokens=6, ignore_eos=True)
    aggregated = run(make_engine(tokens_per_block=16), {"r": (prompt, params)})["r"]

    context, generation = make_engine(tokens_per_block=16), make_engine(tokens_per_block=16)
    result = context.prefill("r", prompt, params.num_candidates)
    assert context.state_pool is not None and len(result.recurrent_state) == context.state_pool.state_bytes
    context.check_integrity()
    reservation = generation.reserve_prompt("r", prompt, params=params)
    assert generation.state_pool is not None
    assert generation.state_pool.num_free_slots() == generation.state_pool.num_slots - 3  # W, up front
    generation.check_integrity()
    generation.kv_pool.data[reservation.block_ids] = context.kv_pool.data[result.block_ids]  # the "pull"
    context.release_prefill("r")
    with pytest.raises(ValueError, match="recurrent_state"):
        generation.add_prefilled_request(
            reservation, prompt, params, result.candidate_ids, result.candidate_logprobs
        )
    generation.add_prefilled_request(
        reservation, prompt, params, result.candidate_ids, result.candidate_logprobs, result.recurrent_state
    )
    outputs: dict[str, RequestOutput] = {}
    while generation.has_unfinished():
        outputs |= {output.request_id: output for output in generation.step() if output.finished}
        generation.check_integrity()
    assert_same(outputs["r"], aggregated)
    # A block-aligned prompt leaves its last block with the shipped state as its snapshot.
    assert generation.kv_cache.tree.num_snapshots() == (1 if prompt_len % 16 == 0 else 0)


def test_a_cancelled_reservation_returns_its_state_slots() -> None:
    engine = make_engine(tokens_per_block=16)
    assert engine.state_pool is not None
    engine.reserve_prompt("r", prompt_of(20, 1), params=SamplingParams(beam_width=4, max_new_tokens=4))
    assert engine.state_pool.num_free_slots() == engine.state_pool.num_slots - 4
    engine.check_integrity()
    engine.cancel_reservation("r")
    assert engine.state_pool.num_free_slots() == engine.state_pool.num_slots
    assert engine.num_blocks_in_use() == 0
    engine.check_integrity()
