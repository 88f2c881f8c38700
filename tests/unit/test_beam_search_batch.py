"""Beam searches of one step together (one `topk` for all requests) against one call each.

The reference is the per-request step as it was before issue 29's perf5 branch: the running
scores added to [1, W, V], one `topk` over [1, W V], then the advance of that one request (since
stop 29 the advance runs R requests of one params together; transformers' own beams are
tests/unit/test_beam_search_parity.py's reference). Log-probs are drawn from a few
values, so the top 2W candidates tie often (inside a request and across beams): the batched call
must pick the same candidates in the same order with the same scores, and leave every request in
the same state.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.beam_search import BeamSearch, BeamSearchParams, BeamStep, step_beam_searches
from engine.config import SamplingParams
from engine.request import make_decoder, step_decoders
from engine.sampling import SingleSequence

VOCAB = 4099  # over 64 x 2W: topk takes its partial_sort path, as on a real vocabulary


def reference_step(search: BeamSearch, logprobs: torch.Tensor) -> BeamStep:
    """BeamSearch.step of one request alone, as before batching (main at 38bb686)."""
    width = search.params.beam_width
    vocab_size = logprobs.shape[-1]
    accumulated = logprobs.to(torch.float32).unsqueeze(0) + search.running_scores[:, :, None]  # [1, W, V]
    accumulated = accumulated.reshape(1, width * vocab_size)  # [1, W*V]
    top_logprobs, top_indices = torch.topk(accumulated, k=search.params.num_candidates)  # [1, K]
    return search._advance(top_logprobs, top_indices // vocab_size, top_indices % vocab_size)


def tied_logprobs(rng: random.Random, num_rows: int, vocab_size: int, num_values: int) -> torch.Tensor:
    """[num_rows, vocab_size] float32 drawn from num_values values: many exact ties."""
    values = torch.tensor([-0.5 * rng.randrange(1, 40) for _ in range(num_values)], dtype=torch.float32)
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return values[torch.randint(num_values, (num_rows, vocab_size), generator=generator)]


def search_state(search: BeamSearch) -> list[torch.Tensor]:
    return [
        search.running_tokens,
        search.running_scores,
        search.finished_tokens,
        search.finished_scores,
        search.finished_logprobs,
        search.finished_lens,
        search.is_finished,
        search.can_improve,
    ]


def make_pair(
    params: BeamSearchParams, start_ids: list[int], start_logprobs: list[float]
) -> tuple[BeamSearch, BeamSearch]:
    searches = BeamSearch(params), BeamSearch(params)
    for search in searches:
        search.start(start_ids, start_logprobs)
    return searches


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("num_values", [3, 12])
def test_searches_step_together_as_alone(width: int, num_values: int) -> None:
    rng = random.Random(width * 100 + num_values)
    num_requests, num_steps = 7, 6
    pairs = []
    for index in range(num_requests):
        params = BeamSearchParams(
            beam_width=width,
            max_new_tokens=num_steps + 1,
            eos_token_id=rng.randrange(VOCAB) if index % 2 else None,
            early_stopping=[False, True, "never"][index % 3],
        )
        # Requests 0 and 1 start from equal candidates: equal running scores, ties across rows too.
        start_logprobs = sorted((-0.5 * rng.randrange(1, 6) for _ in range(2 * width)), reverse=True)
        start_ids = rng.sample(range(VOCAB), 2 * width) if index > 1 else list(range(2 * width))
        pairs.append(make_pair(params, start_ids, start_logprobs))
    num_ties = 0
    for _ in range(num_steps):
        live = [pair for pair in pairs if not pair[0].is_done]
        if not live:
            break
        logprobs = tied_logprobs(rng, len(live) * width, VOCAB, num_values)
        together = step_beam_searches([pair[1] for pair in live], logprobs)
        for index, (alone, batched) in enumerate(live):
            expected = reference_step(alone, logprobs[index * width : (index + 1) * width])
            assert together[index] == expected
            assert all(
                torch.equal(a, b) for a, b in zip(search_state(alone), search_state(batched), strict=True)
            )
            num_ties += int(alone.running_scores.unique().numel() < width)
    assert num_ties > 0  # the draw did make running beams tie


def test_step_decoders_mixes_widths_and_sampling() -> None:
    """Runs of equal widths step together; a sampled sequence and another width step alone;
    every step equals the decoder's own."""
    rng = random.Random(7)
    kinds = [4, 4, 1, 4, 2, 2, 4, 1]
    decoders, references = [], []
    for index, width in enumerate(kinds):
        sampled = width == 1 and index % 2 == 0
        params = SamplingParams(
            beam_width=width, max_new_tokens=5, temperature=0.8 if sampled else 0.0, top_k=5
        )
        pair = [make_decoder(params, eos_token_id=None, seed=index) for _ in range(2)]
        candidates = rng.sample(range(VOCAB), 2 * width)
        start_logprobs = sorted((-0.25 * rng.randrange(1, 9) for _ in range(2 * width)), reverse=True)
        for decoder in pair:
            decoder.start(list(candidates), list(start_logprobs))
        decoders.append(pair[0])
        references.append(pair[1])
    for _ in range(3):
        logprobs = torch.log_softmax(tied_logprobs(rng, sum(kinds), VOCAB, 20), dim=-1)
        steps = step_decoders(decoders, kinds, logprobs)
        row = 0
        for decoder, reference, width, step in zip(decoders, references, kinds, steps, strict=True):
            rows = logprobs[row : row + width]
            expected = (
                reference.step(rows)
                if isinstance(reference, SingleSequence)
                else reference_step(reference, rows)
            )
            assert step == expected
            assert decoder.running_token_ids() == reference.running_token_ids()
            row += width


def test_step_refuses_mixed_widths_and_bad_rows() -> None:
    searches = [BeamSearch(BeamSearchParams(beam_width=width, max_new_tokens=3)) for width in (2, 3)]
    for search in searches:
        search.start(list(range(2 * search.params.beam_width)), [-1.0] * 2 * search.params.beam_width)
    with pytest.raises(ValueError, match="beam_width 3"):
        step_beam_searches(searches, torch.zeros((4, VOCAB)))
    with pytest.raises(ValueError, match="rows"):
        step_beam_searches(searches[:1], torch.zeros((3, VOCAB)))
    with pytest.raises(ValueError, match="num_rows"):
        step_decoders(searches, [2, 3], torch.zeros((4, VOCAB)))
    with pytest.raises(RuntimeError, match="start"):
        step_beam_searches(
            [BeamSearch(BeamSearchParams(beam_width=2, max_new_tokens=3))], torch.zeros((2, VOCAB))
        )


@pytest.mark.parametrize("length_penalty", [1.0, 1.7, -0.5])
def test_one_params_advance_together_at_different_steps_as_alone(length_penalty: float) -> None:
    """Requests of the same params advance in one batched call (advance_searches) though they are
    at different steps (they joined at different times): each row's length normalisation and
    heuristic use its own step, so every request ends in the state, and with the steps, it reaches
    stepping alone."""
    rng = random.Random(int(length_penalty * 10) + 3)
    width, num_requests, max_new = 3, 6, 8
    params = BeamSearchParams(
        beam_width=width,
        max_new_tokens=max_new,
        length_penalty=length_penalty,
        eos_token_id=7,
        early_stopping="never",
    )
    pairs: list[tuple[BeamSearch, BeamSearch]] = []
    for step in range(max_new + 2 * num_requests):
        if step % 2 == 0 and len(pairs) < num_requests:  # a new request every other step
            start_logprobs = sorted((-0.5 * rng.randrange(1, 6) for _ in range(2 * width)), reverse=True)
            pairs.append(make_pair(params, rng.sample(range(VOCAB), 2 * width), start_logprobs))
        live = [pair for pair in pairs if not pair[0].is_done]
        if not live:
            break
        # eos (token 7) often among the best: hypotheses finish at different lengths
        logprobs = tied_logprobs(rng, len(live) * width, VOCAB, 6)
        logprobs[:, 7] = -0.25 * rng.randrange(1, 4)
        together = step_beam_searches([pair[1] for pair in live], logprobs)
        assert len({pair[1].num_steps for pair in live}) > 1 or len(live) == 1
        for index, (alone, batched) in enumerate(live):
            assert together[index] == alone.step(logprobs[index * width : (index + 1) * width])
            assert all(
                torch.equal(a, b) for a, b in zip(search_state(alone), search_state(batched), strict=True)
            )
    assert all(pair[0].is_done and pair[1].is_done for pair in pairs)
    assert any(bool(pair[0].is_finished.any()) for pair in pairs)
