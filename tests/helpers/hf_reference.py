"""transformers' `generate` as the beam search reference, in the engine's terms.

`reference_beams` returns, best first, each beam's generated tokens cut after the first eos, its
score, and whether it stopped on eos. Width 1 is greedy search, for which transformers reports no
sequence score: the summed float32 log-probs of the chosen tokens, normalised like a beam's.
"""

from __future__ import annotations

import copy

import torch

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
