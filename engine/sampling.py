"""Width-1 decoding: greedy, or sampling with temperature, top-k, top-p and a per-request seed.

Greedy matches transformers' greedy search: the argmax of the float32 logits. Sampling draws from a
per-request `torch.Generator`, so a request samples the same tokens alone or in any batch.

Every step goes through `candidates_from_logprobs` first: the first step starts from the
candidates a prefill returns (the same list a context worker ships), later steps build that list
from the full row, so aggregated and disaggregated runs draw identically.

Dimensions: V vocabulary, K candidates.
"""

from __future__ import annotations

import torch

from engine.beam_search import BeamStep
from engine.config import SamplingParams
from engine.stop_strings import StopStringMatcher
from engine.types import Beam


def candidates_from_logprobs(logprobs: torch.Tensor, num_candidates: int) -> tuple[list[int], list[float]]:
    """logprobs: [V]. The best num_candidates (0 or >= V: all V) token ids and log-probs, best first."""
    vocab_size = logprobs.shape[-1]
    count = vocab_size if num_candidates <= 0 else min(num_candidates, vocab_size)
    if count == 1:
        # argmax breaks ties towards the lowest id, as transformers' greedy search does.
        token_id = int(torch.argmax(logprobs))
        return [token_id], [float(logprobs[token_id])]
    values, indices = torch.topk(logprobs, k=count)  # [K]
    return indices.tolist(), values.tolist()


def sample_from_candidates(
    candidate_ids: list[int],
    candidate_logprobs: list[float],
    params: SamplingParams,
    generator: torch.Generator,
) -> int:
    """Draw one token from sorted candidates with the request's temperature, top-k and top-p."""
    logprobs = torch.tensor(candidate_logprobs, dtype=torch.float64)  # [K], best first
    if params.top_k > 0:
        logprobs = logprobs[: params.top_k]
    # Shifted so the best is 0 before scaling: a tiny temperature sends the others to -inf, never
    # all of them (which would make every probability NaN).
    probs = torch.softmax((logprobs - logprobs[0]) / params.temperature, dim=-1)  # [K]
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p; the best token always stays.
        mass_before = torch.cumsum(probs, dim=-1) - probs  # [K]
        probs = torch.where(mass_before < params.top_p, probs, torch.zeros_like(probs))
    choice = int(torch.multinomial(probs, num_samples=1, generator=generator))
    return candidate_ids[choice]


class SingleSequence:
    """Greedy or sampled decoding of one sequence, with the step interface of BeamSearch."""

    def __init__(
        self,
        params: SamplingParams,
        eos_token_id: int | None,
        seed: int,
        stop_matcher: StopStringMatcher | None = None,
    ) -> None:
        self.params = params
        self.eos_token_id = eos_token_id
        self.stop_matcher = stop_matcher
        self.generator = torch.Generator().manual_seed(seed)
        self.token_ids: list[int] = []
        self.cumulative_logprob = 0.0
        self.is_done = False
        self.finish_reason = "length"

    @property
    def num_steps(self) -> int:
        return len(self.token_ids)

    def start(self, candidate_ids: list[int], candidate_logprobs: list[float]) -> BeamStep:
        if not candidate_ids or len(candidate_ids) != len(candidate_logprobs):
            raise ValueError("decoding needs at least one candidate, with one log-prob per id")
        if self.params.is_greedy:
            choice = 0
        else:
            token_id = sample_from_candidates(candidate_ids, candidate_logprobs, self.params, self.generator)
            choice = candidate_ids.index(token_id)
        return self._append(candidate_ids[choice], candidate_logprobs[choice])

    def step(self, logprobs: torch.Tensor) -> BeamStep:
        """logprobs: [1, V] float32 log_softmax of the sequence's last logits."""
        if self.is_done:
            raise RuntimeError("decoding already finished")
        num_candidates = 1 if self.params.is_greedy else self.params.top_k
        candidate_ids, candidate_logprobs = candidates_from_logprobs(logprobs[0], num_candidates)
        return self.start(candidate_ids, candidate_logprobs)

    def _append(self, token_id: int, logprob: float) -> BeamStep:
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if self.eos_token_id is not None and token_id == self.eos_token_id:
            self.is_done, self.finish_reason = True, "stop"
        elif self.stop_matcher is not None and self.stop_matcher.is_stopped(self.token_ids):
            self.is_done, self.finish_reason = True, "stop"
        elif len(self.token_ids) >= self.params.max_new_tokens:
            self.is_done = True
        return BeamStep([0], [token_id], self.is_done)

    def final_beams(self) -> list[Beam]:
        # transformers reports no sequence score for greedy search; this is the beam formula.
        score = self.cumulative_logprob / (len(self.token_ids) ** self.params.length_penalty)
        return [Beam(list(self.token_ids), self.cumulative_logprob, score, self.finish_reason)]

    def running_token_ids(self) -> list[list[int]]:
        return [list(self.token_ids)]
