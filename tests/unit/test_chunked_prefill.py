"""Chunked prefill under the token budget: a prompt cut into chunks gives the bits of a whole one
(float32, batch-invariant kernels), beams beside a long prompt keep decoding while it is
prefilled, the context side batches several prefills into one forward, and an abort part-way
frees everything. `check_integrity()` after every step; every pool ends at zero."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from engine import CacheConfig, EngineConfig, LLMEngine, OutOfBlocksError, RequestOutput, SamplingParams
from engine.request import RequestState

TOKENS_PER_BLOCK = 16
WHOLE = 4096  # a budget no prompt here reaches: every prompt runs in one pass


def make_engine(budget: int, model: str = "tiny", num_blocks: int = 256, max_num_seqs: int = 8) -> LLMEngine:
    cache = CacheConfig(tokens_per_block=TOKENS_PER_BLOCK, num_blocks=num_blocks)
    config = EngineConfig(
        model=model,
        dtype="float32",
        cache=cache,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        batch_invariant=True,
    )
    return LLMEngine(config)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def prompt_of(length: int, offset: int) -> list[int]:
    return [(offset + 7 * index) % 250 for index in range(length)]


def run_to_completion(engine: LLMEngine, outputs: dict[str, RequestOutput]) -> int:
    """Steps until idle, checking integrity after every step; returns the number of steps."""
    num_steps = 0
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
        engine.check_integrity()
        num_steps += 1
    return num_steps


def count_forwards(engine: LLMEngine) -> list[int]:
    """Wraps the runner: each forward appends how many sequences it fed."""
    calls: list[int] = []
    compute: Callable[[Any], Any] = engine.runner.forward

    def counted(seqs: Any) -> Any:
        calls.append(len(seqs))
        return compute(seqs)

    engine.runner.forward = counted  # type: ignore[method-assign]
    return calls


# A long prompt (not a multiple of the block, the attention unit or the budget), a prompt that
# extends its prefix (reused on the second run), and a short one.
LONG = prompt_of(301, 3)
REQUESTS = [
    (LONG, SamplingParams(beam_width=3, max_new_tokens=6, ignore_eos=True)),
    (LONG + prompt_of(40, 5), SamplingParams(beam_width=2, max_new_tokens=5)),
    (prompt_of(9, 1), SamplingParams(max_new_tokens=7, ignore_eos=True)),
]


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_chunked_prompt_gives_the_beams_of_a_whole_one(model: str) -> None:
    results, num_steps = {}, {}
    for budget in (WHOLE, 48):
        engine = make_engine(budget, model)
        outputs: dict[str, RequestOutput] = {}
        num_steps[budget] = 0
        for index, (prompt, params) in enumerate(REQUESTS):
            # One after the other, so the second finds the first's prefix in the tree.
            engine.add_request(f"r{index}", prompt, params)
            num_steps[budget] += run_to_completion(engine, outputs)
        assert engine.num_blocks_in_use() == 0
        results[budget] = outputs
    # 301 tokens in 7 chunks of 48 instead of 1, and the second prompt's 53 new ones in 2.
    assert num_steps[48] == num_steps[WHOLE] + 6 + 1
    for index in range(len(REQUESTS)):
        whole, chunked = results[WHOLE][f"r{index}"], results[48][f"r{index}"]
        assert whole.error is None and chunked.error is None
        assert chunked.beams == whole.beams, f"request {index}"  # token ids and float32 scores
        assert chunked.stats["reused_tokens"] == whole.stats["reused_tokens"]
    assert results[48]["r1"].stats["reused_tokens"] > 0, "the second prompt reuses the first's prefix"


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_chunked_context_prefill_equals_a_whole_one(model: str) -> None:
    whole, chunked = make_engine(WHOLE, model), make_engine(40, model)
    forwards = count_forwards(chunked)
    for request_id, prompt in (("a", LONG), ("b", LONG + prompt_of(40, 5))):
        expected = whole.prefill(request_id, prompt, 6)
        assert chunked.prefill(request_id, prompt, 6) == expected  # ids, log-probs, state bytes
        chunked.check_integrity()
    # a: 301 tokens in chunks of 40; b: 341 tokens of which a's 18 full blocks (288 tokens, each
    # with its snapshot for the hybrid model) are reused, the other 53 in chunks of 40.
    assert len(forwards) == -(-301 // 40) + -(-(341 - 288) // 40)
    assert all(num_seqs == 1 for num_seqs in forwards)
    for engine in (whole, chunked):
        engine.release_prefill("a")
        engine.release_prefill("b")
        engine.check_integrity()
        assert engine.num_blocks_in_use() == 0


def test_beams_keep_decoding_while_a_long_prompt_is_prefilled() -> None:
    budget = 64
    engine = make_engine(budget)
    params = SamplingParams(beam_width=2, max_new_tokens=30, ignore_eos=True)
    engine.add_request("short", prompt_of(12, 1), params)
    engine.step()  # its prefill: two beams decoding from now on
    engine.step()
    engine.add_request("long", prompt_of(600, 2), SamplingParams(max_new_tokens=2))
    short_tokens_per_step: list[int] = []
    num_prefill_steps = 0
    outputs: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        long = engine._requests.get("long")
        is_prefilling = long is not None and long.state in (RequestState.WAITING, RequestState.PREFILLING)
        step_outputs = engine.step()
        engine.check_integrity()
        if is_prefilling:
            num_prefill_steps += 1
            deltas = [output.new_token_ids for output in step_outputs if output.request_id == "short"]
            short_tokens_per_step.append(sum(len(beam) for delta in deltas for beam in delta))
        for output in step_outputs:
            if output.finished:
                outputs[output.request_id] = output
    # Every step spends 2 tokens on the short request's beams and 62 on the long prompt.
    assert num_prefill_steps == -(-600 // (budget - 2))
    assert short_tokens_per_step == [2] * num_prefill_steps, "each beam got a token every step"
    assert outputs["short"].error is None and outputs["long"].error is None
    alone = make_engine(WHOLE).generate(prompt_of(600, 2), SamplingParams(max_new_tokens=2))
    assert outputs["long"].beams == alone.beams
    assert engine.num_blocks_in_use() == 0


def test_a_short_prompt_does_not_wait_for_a_long_one_to_finish() -> None:
    """A 40-token prompt arriving while a 600-token prompt is chunked at budget 64 is whole (and
    gives its first token) in the step after it is admitted, long before the long prompt's 10
    chunks are done; both give the beams of their runs alone."""
    budget = 64
    engine = make_engine(budget)
    engine.add_request("long", prompt_of(600, 2), SamplingParams(max_new_tokens=2, ignore_eos=True))
    engine.step()
    engine.step()
    engine.add_request(
        "short", prompt_of(40, 9), SamplingParams(beam_width=2, max_new_tokens=3, ignore_eos=True)
    )
    first_token_step: dict[str, int] = {}
    outputs: dict[str, RequestOutput] = {}
    step = 0
    while engine.has_unfinished():
        step += 1
        for output in engine.step():
            if output.new_token_ids and any(output.new_token_ids):
                first_token_step.setdefault(output.request_id, step)
            if output.finished:
                outputs[output.request_id] = output
        engine.check_integrity()
    # Step 1 admits "short" with no budget left; step 2 runs its whole prompt first (40 tokens)
    # and 24 of the long prompt's; the long one needs 600 / 64 steps or more in all.
    assert first_token_step["short"] <= 2, first_token_step
    assert first_token_step["long"] >= -(-600 // budget) - 1, first_token_step
    for request_id, prompt, params in (
        ("long", prompt_of(600, 2), SamplingParams(max_new_tokens=2, ignore_eos=True)),
        ("short", prompt_of(40, 9), SamplingParams(beam_width=2, max_new_tokens=3, ignore_eos=True)),
    ):
        assert outputs[request_id].beams == make_engine(WHOLE).generate(prompt, params).beams
    assert engine.num_blocks_in_use() == 0


def test_budget_caps_every_forward() -> None:
    budget = 24
    engine = make_engine(budget)
    fed: list[int] = []
    compute = engine.runner.forward

    def counted(seqs: Any) -> Any:
        fed.append(sum(len(seq.token_ids) for seq in seqs))
        return compute(seqs)

    engine.runner.forward = counted  # type: ignore[method-assign]
    for index, length in enumerate((5, 70, 33, 1)):
        engine.add_request(
            f"r{index}", prompt_of(length, index), SamplingParams(beam_width=2, max_new_tokens=4)
        )
    run_to_completion(engine, {})
    assert max(fed) == budget and all(0 < num_tokens <= budget for num_tokens in fed)
    assert engine.num_blocks_in_use() == 0


def test_context_prefills_are_batched_into_one_forward() -> None:
    prompts = [prompt_of(30, 1), prompt_of(57, 2), prompt_of(12, 3)]
    alone = make_engine(WHOLE)
    expected = [alone.prefill(f"p{index}", prompt, 4) for index, prompt in enumerate(prompts)]
    engine = make_engine(WHOLE)
    forwards = count_forwards(engine)
    for index, prompt in enumerate(prompts):
        engine.add_prefill(f"p{index}", prompt, 4)
    engine.check_integrity()
    outputs = engine.step()
    engine.check_integrity()
    assert forwards == [3], "one forward for the three prompts"
    assert [output.prefill for output in outputs] == expected
    assert all(output.finished and output.error is None for output in outputs)
    assert not engine.has_unfinished()
    for index in range(len(prompts)):
        engine.release_prefill(f"p{index}")
    engine.check_integrity()
    assert engine.num_blocks_in_use() == 0


def test_context_prefills_share_the_budget_in_chunks() -> None:
    prompts = [prompt_of(30, 1), prompt_of(100, 2), prompt_of(20, 3)]
    alone = make_engine(WHOLE)
    expected = {f"p{index}": alone.prefill(f"p{index}", prompt, 0) for index, prompt in enumerate(prompts)}
    engine = make_engine(64)
    forwards = count_forwards(engine)
    for index, prompt in enumerate(prompts):
        engine.add_prefill(f"p{index}", prompt, 0)  # 0: the whole vocabulary
    done_at: dict[str, int] = {}
    results = {}
    for step_index in range(10):
        for output in engine.step():
            assert output.prefill is not None
            results[output.request_id] = output.prefill
            done_at[output.request_id] = step_index
        engine.check_integrity()
        if not engine.has_unfinished():
            break
    # 150 tokens: the prompts that fit in a step first (p0, p2), then p1, which does not:
    # [30 of p0 + 20 of p2 + 14 of p1], [64 of p1], [22 of p1].
    assert forwards == [3, 1, 1]
    assert done_at == {"p0": 0, "p2": 0, "p1": 2}
    assert results == expected
    for request_id in expected:
        engine.release_prefill(request_id)
    assert engine.num_blocks_in_use() == 0


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_abort_drops_a_half_prefilled_request(model: str) -> None:
    engine = make_engine(32, model)
    engine.add_prefill("ctx", prompt_of(200, 1), 4)
    engine.add_request("agg", prompt_of(150, 2), SamplingParams(beam_width=2, max_new_tokens=4))
    engine.step()
    engine.step()
    engine.check_integrity()
    request = engine._requests["ctx"]
    assert request.state is RequestState.PREFILLING and 0 < request.num_computed_tokens < 200
    assert engine.num_blocks_in_use() > 0
    engine.abort("ctx")
    engine.check_integrity()
    engine.abort("agg")  # admitted once ctx's chunks left it budget, or still queued
    engine.check_integrity()
    assert not engine.has_unfinished()
    assert engine.num_blocks_in_use() == 0
    # What its chunks wrote stays published (cached, free to evict): the whole blocks and no more.
    assert engine.kv_cache.allocator.num_cached_blocks() == request.num_computed_tokens // TOKENS_PER_BLOCK


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
@pytest.mark.parametrize("context_side", [False, True])
def test_a_prompt_admitted_mid_prefill_reuses_the_blocks_already_written(
    model: str, context_side: bool
) -> None:
    """A prompt's full blocks are published chunk by chunk: a prompt sharing its prefix, admitted
    while the first is still in its chunks, starts from them and gets the bits it gets alone."""
    budget, first, second = 48, LONG, LONG[:200] + prompt_of(60, 9)
    params = SamplingParams(beam_width=2, max_new_tokens=5, ignore_eos=True)
    alone = {}
    for request_id, prompt in (("first", first), ("second", second)):
        engine = make_engine(WHOLE, model)
        if context_side:
            alone[request_id] = engine.prefill(request_id, prompt, 6)
        else:
            outputs: dict[str, RequestOutput] = {}
            engine.add_request(request_id, prompt, params)
            run_to_completion(engine, outputs)
            alone[request_id] = outputs[request_id].beams

    engine = make_engine(budget, model)
    results: dict[str, Any] = {}

    def add(request_id: str, prompt: list[int]) -> None:
        if context_side:
            engine.add_prefill(request_id, prompt, 6)
        else:
            engine.add_request(request_id, prompt, params)

    def collect(outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.finished:
                assert output.error is None, output.error
                results[output.request_id] = output.prefill if context_side else output.beams
                if not context_side:
                    results[output.request_id + ".reused"] = output.stats["reused_tokens"]

    add("first", first)
    for _ in range(3):  # 3 chunks of 48: 144 tokens, 9 whole blocks of 16
        collect(engine.step())
        engine.check_integrity()
    assert engine._requests["first"].num_computed_tokens == 144
    add("second", second)  # admitted by the next step, before that step's chunk of the first runs
    while engine.has_unfinished():
        collect(engine.step())
        engine.check_integrity()
    if context_side:
        for request_id in ("first", "second"):
            got, expected = results[request_id], alone[request_id]
            assert got.candidate_ids == expected.candidate_ids, request_id
            assert got.candidate_logprobs == expected.candidate_logprobs, request_id
            assert got.recurrent_state == expected.recurrent_state, request_id
        assert results["second"].reused_tokens == 144, "it starts from the first's written blocks"
        for request_id in ("first", "second"):
            engine.release_prefill(request_id)
    else:
        assert results["first"] == alone["first"] and results["second"] == alone["second"]
        assert results["second.reused"] == 144, "it starts from the first's written blocks"
    engine.check_integrity()
    assert engine.num_blocks_in_use() == 0


def test_add_prefill_out_of_blocks_holds_nothing() -> None:
    engine = make_engine(WHOLE, num_blocks=4)
    engine.add_prefill("fits", prompt_of(40, 1), 2)  # 3 blocks
    with pytest.raises(OutOfBlocksError):
        engine.add_prefill("too-big", prompt_of(40, 2), 2)
    engine.check_integrity()
    assert engine.num_blocks_in_use() == 3
    with pytest.raises(ValueError, match="already in use"):
        engine.add_prefill("fits", prompt_of(40, 1), 2)
    (output,) = engine.step()
    assert output.prefill is not None and output.prefill.prompt_len == 40
    engine.release_prefill("fits")
    engine.check_integrity()
    assert engine.num_blocks_in_use() == 0


def test_budget_below_max_num_seqs_is_refused() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)
