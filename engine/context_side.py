"""The context side of LLMEngine: prompts prefilled with one beam and pinned until released.

`add_prefill` allocates a prompt now; the engine's `step` runs it in chunks next to other work
and, with its last chunk, commits and pins its blocks and returns its first-step candidates
(`RequestOutput.prefill`). `prefill` does the same for one prompt, synchronously.
`release_prefill` unpins. The engine's state lives on LLMEngine (engine/llm_engine.py), which
mixes this in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.config import SamplingParams
from engine.kv_group_tables import counts_text, group_page_ids
from engine.request import Request
from engine.request_checks import check_fits_pool, check_prompt
from engine.sampling import candidates_from_logprobs
from engine.types import PrefillResult

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.kv_group_tables import GroupedTable
    from engine.kv_groups import KVGroups
    from engine.kv_pool import GroupedKVPool
    from engine.model_runner import ModelRunner, SequenceInput
    from engine.models.config import ModelConfig
    from engine.scheduler import Scheduler
    from engine.state_pool import StatePool


class ContextSide:
    """Mixed into LLMEngine; what it uses of LLMEngine is declared here."""

    if TYPE_CHECKING:
        config: EngineConfig
        model_config: ModelConfig
        kv_cache: KVGroups
        kv_pool: GroupedKVPool
        state_pool: StatePool | None
        runner: ModelRunner
        scheduler: Scheduler
        _requests: dict[str, Request]
        _prefilled: dict[str, GroupedTable]  # the pinned prompts

        def abort(self, request_id: str) -> None: ...
        def _chunk_input(self, request: Request, num_tokens: int) -> SequenceInput: ...
        def _commit_prompt(self, request: Request, num_tokens: int | None = None) -> None: ...

    def add_prefill(
        self,
        request_id: str,
        prompt_ids: list[int],
        num_candidates: int,
        salt: bytes = b"",
        prompt_logprobs: int | None = None,
    ) -> None:
        """Queue a prefill with one beam; the prompt's blocks are allocated now.

        Following `step`s run the prompt in chunks next to the batch's other work; the step that
        runs its last chunk commits it, pins its blocks until `release_prefill`, and returns a
        finished RequestOutput whose `prefill` holds the PrefillResult. num_candidates <= 0 asks
        for the whole vocabulary. Raises OutOfBlocksError (nothing held) when the pool cannot take
        the prompt now, PoolTooSmallError when it never can; `abort` drops it at any point and
        frees its blocks. prompt_logprobs (k, or None): the result carries every position's
        log-prob and best k (SamplingParams.prompt_logprobs); the prompt then skips the prefix cache.
        """
        check_prompt(self.model_config, prompt_ids, 0)
        if request_id in self._prefilled or request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # Every group's most pages at once (one group: the prompt's blocks), in the shared pool.
        needs = self.kv_cache.blocks_needed(
            len(prompt_ids), len(prompt_ids), 1, chunk_tokens=self.config.max_num_batched_tokens
        )
        check_fits_pool(
            request_id, f"{counts_text(needs)} blocks for its prompt", sum(needs), self.kv_cache.num_blocks()
        )
        params = SamplingParams(prompt_logprobs=prompt_logprobs)
        request = Request(request_id, list(prompt_ids), params, None, salt)
        request.prefill_num_candidates = num_candidates
        self.scheduler.add_prefill_only(request)
        self._requests[request_id] = request

    def prefill(
        self,
        request_id: str,
        prompt_ids: list[int],
        num_candidates: int,
        salt: bytes = b"",
        prompt_logprobs: int | None = None,
    ) -> PrefillResult:
        """`add_prefill` run to its end now, alone: chunks under the token budget, no other
        request advances. Raises OutOfBlocksError (nothing held) when the pool cannot take it."""
        self.add_prefill(request_id, prompt_ids, num_candidates, salt, prompt_logprobs)
        request = self._requests[request_id]
        try:
            while True:
                num_tokens = min(request.num_uncomputed_tokens, self.config.max_num_batched_tokens)
                # Sliding groups take the chunk's blocks now (OutOfBlocksError: aborted below).
                self.kv_cache.extend_for_chunk(request.tables[0], request.num_computed_tokens + num_tokens)
                forward = self.runner.forward([self._chunk_input(request, num_tokens)])
                request.prompt_scores.extend(forward.scores[0])
                request.num_computed_tokens += num_tokens
                if request.num_uncomputed_tokens == 0:
                    return self._complete_prefill(request, forward.logprobs[0], forward.model_logprobs[0])
                # As step() does: publish what is whole, release what the next chunk cannot see.
                self._commit_prompt(request, request.num_computed_tokens)
        except BaseException:
            self.abort(request_id)
            raise

    def release_prefill(self, request_id: str) -> None:
        """Unpin a prefilled prompt (unknown or already released ids are ignored)."""
        table = self._prefilled.pop(request_id, None)
        if table is not None:
            self.kv_cache.free(table)

    def _complete_prefill(
        self, request: Request, logprobs: torch.Tensor, model_logprobs: torch.Tensor
    ) -> PrefillResult:
        """A prefill-only request's last chunk ran: commit and pin its table, return its candidates.

        logprobs: [V] float32 of the last prompt position (the decoders'); model_logprobs: [V] the
        same in the model's precision (the scoring records')."""
        assert request.prefill_num_candidates is not None
        self._commit_prompt(request)
        state = self.state_pool.read(request.state_slot_ids[0]) if self.state_pool is not None else b""
        table = request.tables[0]
        request.tables = []  # handed over to the pins: remove() frees only the state slot
        self._requests.pop(request.request_id, None)
        self.scheduler.remove(request)
        self._prefilled[request.request_id] = table
        candidate_ids, candidate_logprobs = candidates_from_logprobs(logprobs, request.prefill_num_candidates)
        # A float32 model reports the decoder's own values: nothing more to ship (sampling may
        # ship the whole vocabulary's candidates).
        is_same = model_logprobs.dtype == logprobs.dtype  # report_dtype float32: the same row
        model_values = [] if is_same else model_logprobs[candidate_ids].tolist()
        return PrefillResult(
            request.request_id, list(table.block_ids), request.prompt_len, candidate_ids, candidate_logprobs,
            request.num_cached_tokens,
            candidate_model_logprobs=model_values,
            recurrent_state=state,
            num_tokens_before_hybrid_pruning=request.num_tokens_before_hybrid_pruning,
            prompt_logprobs=list(request.prompt_scores) if request.wants_prompt_logprobs else None,
            group_page_ids=group_page_ids(table),
            region_page_ids=self.kv_pool.region_pages.pages(table.group_block_ids()),
        )  # fmt: skip
