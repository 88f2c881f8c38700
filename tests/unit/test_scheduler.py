"""Continuous batching: a request's beams do not depend on its neighbours, admission respects the
pool, growth short of blocks waits or fails cleanly, and every pool returns to its baseline.

float64 tiny model, so batching (different matmul shapes) cannot move a float32 rounding.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine import CacheConfig, EngineConfig, LLMEngine, RequestOutput, SamplingParams

TOKENS_PER_BLOCK = 16


def make_engine(num_blocks: int = 256, max_num_seqs: int = 64) -> LLMEngine:
    cache = CacheConfig(tokens_per_block=TOKENS_PER_BLOCK, num_blocks=num_blocks)
    return LLMEngine(EngineConfig(dtype="float64", cache=cache, max_num_seqs=max_num_seqs))


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def prompt_of(length: int, offset: int) -> list[int]:
    return [(offset + 7 * index) % 250 for index in range(length)]


# (prompt, params): beams of 1-4, greedy and sampled, eos on and off, lengths across blocks
MIXED_REQUESTS = [
    (prompt_of(5, 1), SamplingParams(beam_width=3, max_new_tokens=9)),
    (prompt_of(16, 2), SamplingParams(beam_width=1, max_new_tokens=12)),
    (
        prompt_of(33, 3),
        SamplingParams(beam_width=4, max_new_tokens=6, length_penalty=0.5, early_stopping=True),
    ),
    (prompt_of(20, 4), SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=7)),
    (prompt_of(47, 5), SamplingParams(beam_width=2, max_new_tokens=14, length_penalty=2.0, ignore_eos=True)),
    (prompt_of(16, 2), SamplingParams(beam_width=2, max_new_tokens=5, early_stopping="never")),
    (prompt_of(1, 6), SamplingParams(beam_width=4, max_new_tokens=8)),
]


def run_to_completion(engine: LLMEngine, outputs: dict[str, RequestOutput]) -> list[int]:
    """Steps until idle, checking integrity after every step; returns blocks in use per step."""
    in_use = []
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
        engine.check_integrity()
        in_use.append(engine.num_blocks_in_use())
    return in_use


@pytest.fixture(scope="module")
def alone_outputs() -> list[RequestOutput]:
    torch.set_num_threads(1)
    engine = make_engine()
    return [engine.generate(prompt, params) for prompt, params in MIXED_REQUESTS]


def test_batch_gives_each_request_its_beams_alone(alone_outputs: list[RequestOutput]) -> None:
    engine = make_engine()
    outputs: dict[str, RequestOutput] = {}
    # Half join at once; the rest join between steps while the first ones decode.
    for index, (prompt, params) in enumerate(MIXED_REQUESTS[:4]):
        engine.add_request(f"r{index}", prompt, params)
    for index, (prompt, params) in enumerate(MIXED_REQUESTS[4:], start=4):
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
        engine.check_integrity()
        engine.add_request(f"r{index}", prompt, params)
    run_to_completion(engine, outputs)
    for index, alone in enumerate(alone_outputs):
        assert outputs[f"r{index}"].beams == alone.beams, f"request {index}"
        assert outputs[f"r{index}"].error is None
    assert engine.num_blocks_in_use() == 0


def test_admission_respects_the_pool(alone_outputs: list[RequestOutput]) -> None:
    num_blocks = 24
    engine = make_engine(num_blocks=num_blocks)
    outputs: dict[str, RequestOutput] = {}
    for index, (prompt, params) in enumerate(MIXED_REQUESTS):
        engine.add_request(f"r{index}", prompt, params)
    saw_queue = False
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
        engine.check_integrity()
        running = engine.scheduler.running
        saw_queue |= bool(running and engine.scheduler.waiting)
        # Every admitted request's bound fits in the pool at once, and nobody exceeds its bound.
        assert sum(request.formula_blocks for request in running) <= num_blocks
        assert all(request.peak_blocks <= request.formula_blocks for request in running)
        assert engine.num_blocks_in_use() <= num_blocks
    assert saw_queue, "the pool should have made some requests wait"
    for index, alone in enumerate(alone_outputs):
        assert outputs[f"r{index}"].beams == alone.beams, f"request {index}"
        assert outputs[f"r{index}"].stats["peak_blocks"] <= outputs[f"r{index}"].stats["formula_blocks"]
    assert engine.num_blocks_in_use() == 0


def test_max_num_seqs_bounds_the_beams_in_flight() -> None:
    engine = make_engine(max_num_seqs=4)
    for index in range(3):
        engine.add_request(f"r{index}", prompt_of(10, index), SamplingParams(beam_width=3, max_new_tokens=3))
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        assert engine.scheduler.num_running_beams() <= 4
    assert engine.num_blocks_in_use() == 0


def test_growth_waits_for_pinned_blocks_then_resumes(alone_outputs: list[RequestOutput]) -> None:
    prompt, params = MIXED_REQUESTS[4]  # 47 tokens, 2 beams, 14 new: bound 2 + 2 * 2 = 6 blocks
    engine = make_engine(num_blocks=8)
    outputs: dict[str, RequestOutput] = {}
    engine.add_request("beams", prompt, params)
    engine.step()  # prefill: the prompt's 3 blocks
    # A pinned prompt takes every free block; the beams cannot cross into a new block.
    engine.prefill("pinned", prompt_of(engine.kv_cache.num_free_blocks() * TOKENS_PER_BLOCK, 9), 2)
    assert engine.kv_cache.num_free_blocks() == 0
    for _ in range(3):
        for output in engine.step():
            assert not output.finished
        engine.check_integrity()
    assert engine.scheduler.running[0].pending is not None
    engine.release_prefill("pinned")
    run_to_completion(engine, outputs)
    assert outputs["beams"].beams == alone_outputs[4].beams
    assert engine.num_blocks_in_use() == 0


def test_growth_fails_cleanly_when_no_block_will_come_back() -> None:
    context, generation = make_engine(), make_engine(num_blocks=4)
    prompt = prompt_of(40, 3)
    params = SamplingParams(beam_width=4, max_new_tokens=30)  # bound 2 + 4 * 3 = 14 > 4 blocks
    prefilled = context.prefill("r", prompt, params.num_candidates)
    reservation = generation.reserve_prompt("r", prompt)  # no params: no admission check
    generation.add_prefilled_request(
        reservation, prompt, params, prefilled.candidate_ids, prefilled.candidate_logprobs
    )
    outputs: dict[str, RequestOutput] = {}
    run_to_completion(generation, outputs)
    assert (
        outputs["r"].finished and outputs["r"].error is not None and "out of KV blocks" in outputs["r"].error
    )
    assert generation.num_blocks_in_use() == 0
    context.release_prefill("r")
    assert context.num_blocks_in_use() == 0


def test_abort_frees_everything() -> None:
    engine = make_engine()
    engine.add_request("a", prompt_of(40, 1), SamplingParams(beam_width=4, max_new_tokens=20))
    engine.add_request("b", prompt_of(3, 2), SamplingParams(beam_width=2, max_new_tokens=20))
    engine.step()
    engine.step()
    engine.abort("a")
    engine.check_integrity()
    engine.prefill("p", prompt_of(20, 3), 4)
    engine.reserve_prompt("q", prompt_of(50, 4))
    engine.abort("p")
    engine.abort("q")
    engine.abort("b")
    engine.check_integrity()
    assert not engine.has_unfinished()
    assert engine.num_blocks_in_use() == 0


@pytest.mark.parametrize("request_index", [0, 2, 3, 4])
def test_disaggregated_equals_aggregated(alone_outputs: list[RequestOutput], request_index: int) -> None:
    prompt, params = MIXED_REQUESTS[request_index]
    context, generation = make_engine(), make_engine()
    for attempt in range(2):  # the second time, generation's own tree already holds the prefix
        request_id = f"r{attempt}"
        prefilled = context.prefill(request_id, prompt, params.num_candidates)
        reservation = generation.reserve_prompt(request_id, prompt, params=params)
        assert reservation.num_cached_blocks == (0 if attempt == 0 else (len(prompt) - 1) // TOKENS_PER_BLOCK)
        # The pull: copy only the missing pages, page for page.
        source_ids = prefilled.block_ids[reservation.num_cached_blocks :]
        generation.kv_pool.data[reservation.missing_block_ids] = context.kv_pool.data[source_ids]
        context.release_prefill(request_id)
        generation.add_prefilled_request(
            reservation, prompt, params, prefilled.candidate_ids, prefilled.candidate_logprobs
        )
        outputs: dict[str, RequestOutput] = {}
        run_to_completion(generation, outputs)
        assert outputs[request_id].beams == alone_outputs[request_index].beams
    assert context.num_blocks_in_use() == 0 and generation.num_blocks_in_use() == 0
    context.check_integrity()
    generation.check_integrity()


def test_streamed_deltas_rebuild_the_running_beams() -> None:
    engine = make_engine()
    params = SamplingParams(beam_width=3, max_new_tokens=12, ignore_eos=True)
    engine.add_request("s", prompt_of(21, 8), params)
    live: list[list[int]] = [[]]
    final: RequestOutput | None = None
    while final is None:
        for output in engine.step():
            if output.finished:
                final = output
                break
            live = [
                live[parent] + delta
                for parent, delta in zip(output.parent_indices, output.new_token_ids, strict=True)
            ]
            assert live == engine.scheduler.running[0].decoder.running_token_ids()
    assert final.new_token_ids == [] and len(final.beams) == 3


@pytest.mark.parametrize(
    ("prompt_len", "expected_tables", "expected_copies"),
    [
        # 64 = 2 full blocks: shared by all beams, each beam takes a fresh block for its first token.
        (64, [[0, 1, 2], [0, 1, 3], [0, 1, 4], [0, 1, 5]], 0),
        # 67: the 3-token tail is kept by beam 0 and copied into one new block per further beam.
        (67, [[0, 1, 2], [0, 1, 3], [0, 1, 4], [0, 1, 5]], 3),
    ],
)
def test_expansion_shares_full_prompt_blocks_and_copies_the_tail(
    prompt_len: int, expected_tables: list[list[int]], expected_copies: int
) -> None:
    cache = CacheConfig(tokens_per_block=32, num_blocks=16)
    engine = LLMEngine(EngineConfig(dtype="float64", cache=cache))
    engine.add_request("r", prompt_of(prompt_len, 3), SamplingParams(beam_width=4, max_new_tokens=3))
    engine.step()  # prefill; the first step is decided, the tables not yet expanded
    request = engine.scheduler.running[0]
    assert [table.block_ids for table in request.tables] == [[0, 1, 2] if prompt_len == 67 else [0, 1]]
    engine.step()  # expansion to 4 beams plus one slot each, then the second token
    engine.check_integrity()
    assert [table.block_ids for table in request.tables] == expected_tables
    assert request.copied_blocks == expected_copies
    assert request.peak_blocks == 6 == request.formula_blocks
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert engine.num_blocks_in_use() == 0
