"""One request inside the engine: its prompt, its decoder, the block tables of its live beams.

Lifecycle (states):

    WAITING --admit: prompt blocks allocated--> PREFILLING --forward of the prompt's chunks,
    one per step (num_computed_tokens grows)--> DECODING (pending step decided, tables not yet
    grown) <--> (tables grown, in the batch) --decoder done / abort / error--> FINISHED (every
    block freed)

A request added with its prompt already in the pool (generation side) starts in DECODING. A
prefill-only request (context side, `prefill_num_candidates` set, no decoder) leaves PREFILLING
for FINISHED after its last chunk: its prompt table is handed over, pinned, to the engine.
`pending` is the decoder's last decision (which parent each running beam continues, with which
token); the scheduler applies it to the block tables before the next forward, all or nothing,
so a request that cannot grow simply waits with its state untouched.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.beam_search import BeamSearch, BeamSearchParams, BeamStep, step_beam_searches
from engine.config import SamplingParams
from engine.kv_group_tables import BlockCounts, GroupedTable, num_group_blocks_held
from engine.logprobs import LogprobTrie
from engine.sampling import SingleSequence
from engine.stop_strings import StopStringMatcher
from engine.types import TokenLogprob

Decoder = BeamSearch | SingleSequence


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


def make_decoder(
    params: SamplingParams, eos_token_id: int | None, seed: int, stop_matcher: StopStringMatcher | None = None
) -> Decoder:
    """stop_matcher: the request's stop strings (None: it has none)."""
    if params.beam_width > 1:
        return BeamSearch(
            BeamSearchParams(
                beam_width=params.beam_width,
                max_new_tokens=params.max_new_tokens,
                length_penalty=params.length_penalty,
                early_stopping=params.early_stopping,
                eos_token_id=eos_token_id,
            ),
            stop_matcher,
        )
    return SingleSequence(params, eos_token_id, seed, stop_matcher)


def step_decoders(
    decoders: Sequence[Decoder], num_rows: Sequence[int], logprobs: torch.Tensor
) -> list[BeamStep]:
    """One step of each decoder, in order: logprobs [sum(num_rows), V] float32, decoder i's
    num_rows[i] running rows in turn. Consecutive beam searches of one width W, each running W
    rows, step together: one `topk` for all, the same steps as one call each
    (engine/beam_search.py, `step_beam_searches`)."""
    if len(num_rows) != len(decoders) or sum(num_rows) != logprobs.shape[0]:
        raise ValueError(f"num_rows {list(num_rows)} do not split logprobs of {logprobs.shape[0]} rows")
    steps: list[BeamStep] = []
    row, index = 0, 0
    while index < len(decoders):
        searches: list[BeamSearch] = []
        width = _full_width(decoders[index], num_rows[index])
        while index < len(decoders) and width and _full_width(decoders[index], num_rows[index]) == width:
            decoder = decoders[index]
            assert isinstance(decoder, BeamSearch)
            searches.append(decoder)
            index += 1
        if searches:
            steps.extend(step_beam_searches(searches, logprobs[row : row + len(searches) * width]))
            row += len(searches) * width
            continue
        steps.append(decoders[index].step(logprobs[row : row + num_rows[index]]))
        row, index = row + num_rows[index], index + 1
    return steps


def _full_width(decoder: Decoder, num_rows: int) -> int:
    """The beam width of a beam search that runs all its beams, else 0."""
    if isinstance(decoder, BeamSearch) and decoder.params.beam_width == num_rows:
        return num_rows
    return 0


@dataclass
class RequestTimes:
    arrival: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    decoder: Decoder | None  # None for a prefill-only request, which never decodes
    salt: bytes = b""
    state: RequestState = RequestState.WAITING
    # Before the first step: the prompt's table. After: one table per running beam, in the
    # decoder's running order, each holding the KV of every token fed so far.
    tables: list[GroupedTable] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose KV was there before prefill
    # Prompt tokens whose KV is in the pool: the cached ones, then each chunk run so far.
    #   0 ...... num_cached_tokens ...... num_computed_tokens ...... prompt_len
    #   [ reused ][ computed in earlier chunks ][ still to run (next chunks) ]
    num_computed_tokens: int = 0
    # Context side: prefill only, then return this many first-step candidates (<= 0: all).
    prefill_num_candidates: int | None = None
    pending: BeamStep | None = None  # decided, not yet applied to the tables
    # Progress applying `pending`, kept so a request that ran short of blocks resumes exactly:
    # first the tables are reordered (one all-or-nothing call), then each gets one slot.
    is_reordered: bool = False
    num_grown_tables: int = 0
    # Per live beam, the tokens decided since the last RequestOutput; and which earlier live
    # beam each continues (beams reorder, so deltas alone cannot be stitched).
    unsent_token_ids: list[list[int]] = field(default_factory=list)
    unsent_parent_indices: list[int] = field(default_factory=list)
    error: str | None = None
    formula_blocks: int = 0  # the admission bound, summed over KV groups
    # Per KV group: the bound (formula_blocks' terms), and the bound from the first decode step on
    # (a sliding group no longer holds the whole prompt then).
    formula_group_blocks: BlockCounts = ()
    decode_group_blocks: BlockCounts = ()
    peak_blocks: int = 0
    reused_tokens: int = 0
    # What the attention pages alone supported (> reused_tokens when a hybrid model's snapshots
    # cut the match); equals reused_tokens for a model without recurrent layers.
    num_tokens_before_hybrid_pruning: int = 0
    # Sliding windows (docs/cache.md): what the full-attention layers alone could reuse, and what
    # the sliding layers alone allow; reused_tokens is what all groups could continue from.
    full_attention_reusable_tokens: int = 0
    window_reusable_tokens: int = 0
    # Hybrid models: one recurrent-state slot per beam, slot i for running beam i.
    state_slot_ids: list[int] = field(default_factory=list)
    new_blocks: int = 0
    copied_blocks: int = 0
    num_steps: int = 0
    times: RequestTimes = field(default_factory=RequestTimes)
    # Scoring: prompt positions 1 .. num_computed_tokens - 1 so far (prompt_logprobs asked), and
    # the beams' generated tokens (logprobs asked).
    prompt_scores: list[TokenLogprob] = field(default_factory=list)
    logprob_trie: LogprobTrie | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_beams(self) -> int:
        return self.params.beam_width

    @property
    def is_prefill_only(self) -> bool:
        return self.prefill_num_candidates is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Every prompt position needs its logits: the prompt skips the prefix cache."""
        return self.params.prompt_logprobs is not None

    def score_targets(self, start: int, end: int) -> list[int]:
        """The tokens following prompt positions [start, end) that have a following prompt token."""
        if not self.wants_prompt_logprobs:
            return []
        return self.prompt_ids[start + 1 : end + 1]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Prompt tokens still to run through the model (0 once the last chunk has run)."""
        return self.prompt_len - self.num_computed_tokens

    @property
    def active_decoder(self) -> Decoder:
        if self.decoder is None:
            raise RuntimeError(f"request {self.request_id!r} is prefill-only and has no decoder")
        return self.decoder

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def is_ready(self) -> bool:
        """Every running beam has a slot for its pending token: the request can join a forward."""
        return self.pending is not None and self.is_reordered and self.num_grown_tables == len(self.tables)

    def num_group_blocks_held(self) -> BlockCounts:
        return num_group_blocks_held(self.tables, len(self.formula_group_blocks))

    def num_blocks_held(self) -> int:
        return sum(self.num_group_blocks_held())

    def remaining_blocks(self) -> BlockCounts:
        """Per KV group, blocks this request may still take before reaching its bound (its decode
        bound once it decodes)."""
        bound = self.decode_group_blocks if self.state is RequestState.DECODING else self.formula_group_blocks
        held = self.num_group_blocks_held()
        return tuple(max(0, need - have) for need, have in zip(bound, held, strict=True))

    def record_step(self, step: BeamStep) -> None:
        """The decoder decided one more token per running beam; remember it for the next output."""
        previous = self.unsent_token_ids
        if not previous:
            # Nothing unsent: each live beam's delta is its new token.
            self.unsent_token_ids = [[token_id] for token_id in step.token_ids]
            self.unsent_parent_indices = list(step.parent_indices)
        else:
            self.unsent_token_ids = [
                previous[parent] + [token_id]
                for parent, token_id in zip(step.parent_indices, step.token_ids, strict=True)
            ]
            self.unsent_parent_indices = [
                self.unsent_parent_indices[parent] for parent in step.parent_indices
            ]
        self.pending = None if step.is_done else step
        self.is_reordered, self.num_grown_tables = False, 0
        self.num_steps += 1
        if self.times.first_token is None:
            self.times.first_token = time.monotonic()

    def take_deltas(self) -> tuple[list[list[int]], list[int]]:
        deltas, parents = self.unsent_token_ids, self.unsent_parent_indices
        self.unsent_token_ids, self.unsent_parent_indices = [], []
        return deltas, parents

    def stats(self) -> dict[str, float | int]:
        times = self.times
        end = times.finished if times.finished is not None else time.monotonic()
        stats: dict[str, float | int] = {
            "prompt_tokens": self.prompt_len,
            "reused_tokens": self.reused_tokens,
            "num_tokens_before_hybrid_pruning": self.num_tokens_before_hybrid_pruning,
            "full_attention_reusable_tokens": self.full_attention_reusable_tokens,
            "window_reusable_tokens": self.window_reusable_tokens,
            "new_blocks": self.new_blocks,
            "copied_blocks": self.copied_blocks,
            "peak_blocks": self.peak_blocks,
            "formula_blocks": self.formula_blocks,
            "decode_steps": self.num_steps,
            "total_s": end - times.arrival,
        }
        if times.admitted is not None:
            stats["queue_s"] = times.admitted - times.arrival
        if times.first_token is not None:
            stats["first_token_s"] = times.first_token - times.arrival
        return stats


@dataclass
class Reservation:
    """Generation side: a prompt's blocks, reserved while its pages are pulled."""

    table: GroupedTable
    prompt_ids: list[int]
    salt: bytes
    new_blocks: int
    state_slot_ids: list[int]  # hybrid, with params: the request's W slots, taken up front
    # with params: the request's block bound per KV group, promised while its pull runs
    bound_blocks: BlockCounts = ()
    full_attention_reusable_tokens: int = 0  # the diagnostic of its allocation (Request's fields)
    window_reusable_tokens: int = 0

    def remaining_blocks(self) -> BlockCounts:
        if not self.bound_blocks:
            return tuple(0 for _ in self.table.tables)
        held = num_group_blocks_held([self.table], len(self.table.tables))
        return tuple(max(0, need - have) for need, have in zip(self.bound_blocks, held, strict=True))
