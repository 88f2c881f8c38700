"""transformers' `generate` as the beam search reference, in the engine's terms.

`reference_beams` returns, best first, each beam's generated tokens cut after the first eos, its
score, and whether it stopped on eos. Width 1 is greedy search, for which transformers reports no
sequence score: the summed float32 log-probs of the chosen tokens, normalised like a beam's.
"""

from __future__ import annotations

import copy
import math

import torch

from engine import LLMEngine, RequestOutput, SamplingParams

ReferenceBeam = tuple[list[int], float, bool]


def reference_beams(
    model: torch.nn.Module,
    prompt: list[int],
    beam_width: int,
    max_new_tokens: int,
    length_penalty: float,
    early_stopping: bool | str,
    eos_token_id: int | None,
) -> list[ReferenceBeam]:
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = eos_token_id
    config.pad_token_id = 0
    config.max_new_tokens = max_new_tokens
    config.num_beams = beam_width
    config.num_return_sequences = beam_width
    config.length_penalty = length_penalty
    config.early_stopping = early_stopping
    config.do_sample = False
    config.return_dict_in_generate = True
    config.output_scores = True
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), generation_config=config)
    beams = []
    for index in range(beam_width):
        tokens = output.sequences[index, len(prompt) :].tolist()
        stopped = eos_token_id is not None and eos_token_id in tokens
        if stopped:
            tokens = tokens[: tokens.index(eos_token_id) + 1]
        if beam_width > 1:
            score = float(output.sequences_scores[index])
        else:
            logprob = sum(
                float(torch.log_softmax(step_scores[0].to(torch.float32), dim=-1)[token])
                for step_scores, token in zip(output.scores, tokens, strict=False)
            )
            score = logprob / len(tokens) ** length_penalty
        beams.append((tokens, score, stopped))
    return beams


def reference_case(
    model: torch.nn.Module,
    prompt: list[int],
    params: SamplingParams,
    with_eos: bool,
) -> tuple[list[ReferenceBeam], int | None]:
    """transformers' beams for `params` (its beam width, max_new_tokens, length penalty, early
    stopping) and the eos id they were run with: None, or with `with_eos` a token of the reference's
    own beams (best beam first) that, made the eos, ends at least one returned beam (a random model
    may repeat one token, so every beam's tokens are candidates)."""

    def run(eos_token_id: int | None) -> list[ReferenceBeam]:
        return reference_beams(
            model, prompt, params.beam_width, params.max_new_tokens, params.length_penalty,
            params.early_stopping, eos_token_id,
        )  # fmt: skip

    expected = run(None)
    if not with_eos:
        return expected, None
    candidates = list(dict.fromkeys(token for tokens, _, _ in expected for token in tokens[1:] + tokens[:1]))
    for token in candidates:
        beams = run(token)
        if any(stopped for _, _, stopped in beams):
            return beams, token
    raise AssertionError(f"no token of {candidates} ends a beam as eos")


def assert_engine_beams_equal(
    engine: LLMEngine,
    prompt: list[int],
    params: SamplingParams,
    expected: list[ReferenceBeam],
    tolerance: float,
) -> RequestOutput:
    """The engine's beams for `prompt` equal `expected` (tokens, scores to `tolerance`, finish
    reasons); the cache is whole after every step and empty afterwards."""
    request_id = f"beams-{engine.num_blocks_in_use()}-{len(prompt)}-{id(expected)}"
    engine.add_request(request_id, prompt, params)
    output = None
    while output is None:
        for step_output in engine.step():
            engine.check_integrity()
            if step_output.request_id == request_id and step_output.finished:
                output = step_output
    assert engine.num_blocks_in_use() == 0
    assert len(output.beams) == len(expected) == params.beam_width
    for index, (beam, (tokens, score, stopped)) in enumerate(zip(output.beams, expected, strict=True)):
        assert beam.token_ids == tokens, f"beam {index}"
        assert math.isclose(beam.score, score, rel_tol=0.0, abs_tol=tolerance), f"beam {index}"
        assert beam.finish_reason == ("stop" if stopped else "length"), f"beam {index}"
    return output
