"""Beam search for one request, step for step the algorithm of transformers' `generate`.

The state machine is pure: it never sees the model or the KV cache. Each step takes the running
beams' next-token log-probs and answers which (parent beam, token) pairs continue; the engine then
reorders its block tables accordingly. The first step starts from the top-2W candidates of the
last prompt position, the same input a context worker ships, so an aggregated run and a
disaggregated one go through identical arithmetic.

Semantics copied from transformers 5.24 `GenerationMixin._beam_search` (batch of one request):
- Arithmetic is float32, as transformers casts the logits to float32 before `log_softmax`; the
  -1e9 masks, the length normalisation and every top-k run on the same shapes and dtypes, so ties
  and roundings come out the same.
- Each step keeps the top 2W continuations of running-score + log-prob over all (beam, token).
  Of those, candidates that end (eos, a completed stop string, or max_new_tokens reached: what
  transformers' stopping criteria say of each candidate) and rank in the top W become
  finished hypotheses scored `sum_logprob / num_generated ** length_penalty`, where
  `num_generated` counts the generated tokens including the eos (or the token completing a stop
  string). The best W non-ending candidates run on.
- Finished hypotheses keep the best W (`sequences_scores` is that score).
- Stop when: all candidates ended (max length); or early_stopping is True and W hypotheses are
  finished; or the heuristic finds no running beam able to beat the worst finished one, using
  the current generated length (early_stopping False) or, for "never" with length_penalty > 0,
  max_new_tokens.

Dimensions: W beams, V vocabulary, K = 2W candidates, M = max_new_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.stop_strings import StopStringMatcher
from engine.types import Beam

MASK = -1.0e9  # what transformers adds to rule a candidate out


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_new_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")

    @property
    def num_candidates(self) -> int:
        return 2 * self.beam_width


@dataclass(frozen=True)
class BeamStep:
    """What the engine does after one step: running beam i continues parent_indices[i] with token_ids[i]."""

    parent_indices: list[int]  # [W] indices into the previous step's running beams
    token_ids: list[int]  # [W]
    is_done: bool  # no further forward pass is needed


class BeamSearch:
    """The beam state of one request. Not thread-safe; one step at a time."""

    def __init__(self, params: BeamSearchParams, stop_matcher: StopStringMatcher | None = None) -> None:
        """stop_matcher: the request's stop strings, checked on every candidate (None: none)."""
        self.params = params
        self.stop_matcher = stop_matcher
        width, max_new = params.beam_width, params.max_new_tokens
        self.num_steps = 0
        self.is_done = False
        # Running beams, best first.
        self.running_tokens = torch.zeros((1, width, max_new), dtype=torch.int64)  # [1, W, M]
        self.running_scores = torch.zeros((1, width), dtype=torch.float32)  # [1, W] summed log-probs
        # Finished hypotheses, best first; slots not yet filled score MASK.
        self.finished_tokens = torch.zeros((1, width, max_new), dtype=torch.int64)  # [1, W, M]
        self.finished_scores = torch.full((1, width), MASK, dtype=torch.float32)  # [1, W] normalised
        self.finished_logprobs = torch.zeros((1, width), dtype=torch.float32)  # [1, W] summed log-probs
        self.finished_lens = torch.zeros((1, width), dtype=torch.int64)  # [1, W]
        self.is_finished = torch.zeros((1, width), dtype=torch.bool)  # [1, W]
        self.can_improve = torch.ones((1, 1), dtype=torch.bool)  # transformers' heuristic flag
        self.top_width_mask = torch.arange(params.num_candidates) < width  # [K]

    def start(self, candidate_ids: list[int], candidate_logprobs: list[float]) -> BeamStep:
        """First step, from the prompt's top-K next tokens (best first) instead of a [W, V] row."""
        if len(candidate_ids) < self.params.num_candidates or len(candidate_ids) != len(candidate_logprobs):
            raise ValueError(
                f"beam search needs {self.params.num_candidates} candidates, got {len(candidate_ids)} ids "
                f"and {len(candidate_logprobs)} log-probs"
            )
        count = self.params.num_candidates
        logprobs = torch.tensor([candidate_logprobs[:count]], dtype=torch.float32)  # [1, K]
        token_ids = torch.tensor([candidate_ids[:count]], dtype=torch.int64)  # [1, K]
        # Only running beam 0 exists before the first step (transformers masks the others by -1e9).
        order = torch.topk(logprobs, k=count)[1]  # [1, K]
        parents = torch.zeros_like(order)
        return self._advance(logprobs.gather(1, order), parents, token_ids.gather(1, order))

    def step(self, logprobs: torch.Tensor) -> BeamStep:
        """logprobs: [W, V] float32 log_softmax of the running beams' last logits, in running order."""
        return step_beam_searches([self], logprobs)[0]

    def _advance(self, top_logprobs: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor) -> BeamStep:
        """top_logprobs, parents, tokens: [1, K], sorted best first."""
        return advance_searches([self], top_logprobs, parents, tokens)[0]

    def final_beams(self) -> list[Beam]:
        """The W finished hypotheses, best first (only meaningful once is_done)."""
        beams = []
        for slot in range(self.params.beam_width):
            num_tokens = int(self.finished_lens[0, slot])
            token_ids = self.finished_tokens[0, slot, :num_tokens].tolist()
            score = float(self.finished_scores[0, slot])
            stopped = num_tokens > 0 and (
                (self.params.eos_token_id is not None and token_ids[-1] == self.params.eos_token_id)
                or (self.stop_matcher is not None and self.stop_matcher.is_stopped(token_ids))
            )
            beams.append(
                Beam(
                    token_ids=token_ids,
                    cumulative_logprob=float(self.finished_logprobs[0, slot]),
                    score=score,
                    finish_reason="stop" if stopped else "length",
                )
            )
        return beams

    def running_token_ids(self) -> list[list[int]]:
        """[W] lists: the tokens each running beam generated so far."""
        return self.running_tokens[0, :, : self.num_steps].tolist()


def step_beam_searches(searches: Sequence[BeamSearch], logprobs: torch.Tensor) -> list[BeamStep]:
    """One step of R requests of one beam width W: logprobs [R W, V] float32, their running rows
    in order (request by request). The same steps as R calls of `BeamSearch.step`, bit for bit:
    the accumulated scores are the same element-wise adds, and one `topk` over R rows gives each
    row what a call on that row alone gives, ties and their order included. torch's CPU `topk`
    (aten/src/ATen/native/TopKImpl.h, `topk_impl_loop`) selects each row on its own: it fills a
    queue with the row's (value, index) pairs in index order and runs std::partial_sort (or
    nth_element and sort) on it, choosing between them by k and the row length alone; rows are only
    split between threads (tests/unit/test_beam_search_batch.py holds it on tie-heavy rows). The
    per-request `topk` over W x V was the step's largest beam cost: 16 requests of beam 4 over a
    49152-token vocabulary took 16 calls of ~0.5 ms on one thread each."""
    if not searches:
        return []
    width = searches[0].params.beam_width
    num_requests, vocab_size = len(searches), logprobs.shape[-1]
    if logprobs.shape[0] != num_requests * width:
        raise ValueError(f"logprobs has {logprobs.shape[0]} rows, expected {num_requests} x {width}")
    for search in searches:
        if search.params.beam_width != width:
            raise ValueError(f"beam_width {search.params.beam_width} in a step of width {width}")
        if search.num_steps == 0:
            raise RuntimeError("call start() with the prompt's candidates first")
        if search.is_done:
            raise RuntimeError("beam search already finished")
    running_scores = torch.cat([search.running_scores for search in searches])  # [R, W]
    accumulated = (
        logprobs.to(torch.float32).reshape(num_requests, width, vocab_size) + running_scores[:, :, None]
    )
    accumulated = accumulated.view(num_requests, width * vocab_size)  # [R, W*V]
    top_logprobs, top_indices = torch.topk(accumulated, k=searches[0].params.num_candidates)  # [R, K]
    parents, tokens = top_indices // vocab_size, top_indices % vocab_size
    # One advance per distinct params (max_new_tokens and the rest are the request's own)
    rows_by_params: dict[BeamSearchParams, list[int]] = {}
    for index, search in enumerate(searches):
        rows_by_params.setdefault(search.params, []).append(index)
    steps: dict[int, BeamStep] = {}  # row -> its step; the groups cover every row
    for rows in rows_by_params.values():
        picked: tuple[torch.Tensor, ...] = (top_logprobs, parents, tokens)
        if len(rows) < num_requests:
            picked = tuple(tensor[torch.tensor(rows)] for tensor in picked)
        advanced = advance_searches([searches[row] for row in rows], *picked)
        for row, step in zip(rows, advanced, strict=True):
            steps[row] = step
    return [steps[row] for row in range(num_requests)]


def advance_searches(
    searches: Sequence[BeamSearch], top_logprobs: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor
) -> list[BeamStep]:
    """R searches with the same params, one step: top_logprobs, parents, tokens [R, K], each row
    sorted best first. Row r's arithmetic is what search r alone would run (element-wise ops, and
    `topk`, `min`, `all` and `any` within a row), in R rows at once: 16 requests of beam 4 ran
    ~65 tensor ops each a step when they advanced one by one."""
    params = searches[0].params
    width, max_new = params.beam_width, params.max_new_tokens
    num_steps = [search.num_steps for search in searches]
    generated = [step + 1 for step in num_steps]
    num_generated = torch.tensor(generated)[:, None]  # [R, 1]
    running_tokens = torch.cat([search.running_tokens for search in searches])  # [R, W, M]
    candidate_tokens = running_tokens.gather(
        1, parents[:, :, None].expand(-1, -1, max_new)
    ).clone()  # [R, K, M]
    positions = (num_generated - 1)[:, :, None].expand(-1, tokens.shape[1], 1)
    candidate_tokens.scatter_(2, positions, tokens[:, :, None])
    hits_stop = _hits_stop(searches, tokens, candidate_tokens, generated, num_generated)  # [R, K]

    # Running beams for the next step: the best W candidates that did not end.
    running_logprobs = top_logprobs + hits_stop.to(torch.float32) * MASK
    next_order = torch.topk(running_logprobs, k=width)[1]  # [R, W]
    next_tokens = candidate_tokens.gather(1, next_order[:, :, None].expand(-1, -1, max_new))
    running_scores = running_logprobs.gather(1, next_order)
    parent_indices = parents.gather(1, next_order).tolist()
    token_ids = tokens.gather(1, next_order).tolist()

    # Finished hypotheses. Only the top W candidates may finish; the other W exist so that W beams
    # can run on. A row's length normalisation is its own num_generated ** length_penalty (the
    # float a search alone divides by).
    is_finished = torch.cat([search.is_finished for search in searches])  # [R, W]
    finished_scores = torch.cat([search.finished_scores for search in searches])
    can_improve = torch.cat([search.can_improve for search in searches])  # [R, 1]
    just_finished = hits_stop & searches[0].top_width_mask[None, :]  # [R, K]
    scores = top_logprobs / _row_powers(generated, params.length_penalty)
    is_full = torch.all(is_finished, dim=-1, keepdim=True) & (params.early_stopping is True)
    scores += is_full.to(torch.float32) * MASK
    scores += (~can_improve).to(torch.float32) * MASK
    scores += (~just_finished) * MASK
    merged_scores = torch.cat((finished_scores, scores), dim=1)  # [R, W+K]
    order = torch.topk(merged_scores, k=width)[1]  # [R, W]
    merged_tokens = torch.cat(
        (torch.cat([search.finished_tokens for search in searches]), candidate_tokens), dim=1
    )
    merged_lens = torch.cat(
        (torch.cat([search.finished_lens for search in searches]), num_generated.expand_as(hits_stop)), dim=1
    )
    merged_logprobs = torch.cat(
        (torch.cat([search.finished_logprobs for search in searches]), top_logprobs), dim=1
    )
    finished_tokens = merged_tokens.gather(1, order[:, :, None].expand(-1, -1, max_new))
    finished_scores = merged_scores.gather(1, order)
    finished_logprobs = merged_logprobs.gather(1, order)
    finished_lens = merged_lens.gather(1, order)
    is_finished = torch.cat((is_finished, just_finished), dim=1).gather(1, order)

    # transformers' heuristic: can a running beam still beat the worst finished one?
    never = params.early_stopping == "never" and params.length_penalty > 0.0
    best_lengths = [max_new] * len(searches) if never else generated
    best_running = running_scores[:, :1] / _row_powers(best_lengths, params.length_penalty)
    worst_finished = torch.where(is_finished, torch.min(finished_scores, dim=1, keepdim=True)[0], MASK)
    can_improve = can_improve & torch.any(best_running > worst_finished, dim=-1, keepdim=True)

    all_finished = torch.all(is_finished, dim=-1).tolist()
    all_stopped = torch.all(hits_stop, dim=-1).tolist()
    improvable = can_improve[:, 0].tolist()
    steps = []
    for row, search in enumerate(searches):
        exists_open_slot = not (all_finished[row] and params.early_stopping is True)
        search.running_tokens = next_tokens[row : row + 1]
        search.running_scores = running_scores[row : row + 1]
        search.finished_tokens = finished_tokens[row : row + 1]
        search.finished_scores = finished_scores[row : row + 1]
        search.finished_logprobs = finished_logprobs[row : row + 1]
        search.finished_lens = finished_lens[row : row + 1]
        search.is_finished = is_finished[row : row + 1]
        search.can_improve = can_improve[row : row + 1]
        search.num_steps = num_steps[row] + 1
        search.is_done = not (improvable[row] and exists_open_slot and not all_stopped[row])
        steps.append(BeamStep(parent_indices[row], token_ids[row], search.is_done))
    return steps


def _row_powers(lengths: Sequence[int], exponent: float) -> torch.Tensor:
    """[R, 1] float32: length ** exponent per row, the Python float a search alone divides by (a
    float32 tensor divided by a Python float divides by that float rounded to float32)."""
    return torch.tensor([[length**exponent] for length in lengths], dtype=torch.float32)


def _hits_stop(
    searches: Sequence[BeamSearch],
    tokens: torch.Tensor,
    candidate_tokens: torch.Tensor,
    generated: Sequence[int],
    num_generated: torch.Tensor,
) -> torch.Tensor:
    """tokens: [R, K]; candidate_tokens: [R, K, M], each row's first generated[r] filled
    (num_generated: the same counts as a tensor [R, 1]). A candidate ends on eos, a completed stop
    string, or at max_new_tokens."""
    params = searches[0].params
    if params.eos_token_id is None:
        hits = torch.zeros_like(tokens, dtype=torch.bool)
    else:
        hits = tokens == params.eos_token_id
    for row, search in enumerate(searches):
        if search.stop_matcher is not None and generated[row] < params.max_new_tokens:
            sequences = candidate_tokens[row, :, : generated[row]].tolist()  # K lists
            completes = [search.stop_matcher.is_stopped(sequence) for sequence in sequences]
            hits[row] |= torch.tensor(completes, dtype=torch.bool)
    return hits | (num_generated >= params.max_new_tokens)
