"""The generation side of LLMEngine: prompts whose KV is pulled from a context worker.

`reserve_prompt` allocates the prompt's blocks (sharing what this engine's tree holds; a sliding
KV group keeps only the pages the first decode query sees), the caller pulls the missing pages
into them (engine/kv_group_tables.pages_to_pull), `add_prefilled_request` starts decoding from the
shipped candidates. The engine's state lives on LLMEngine (engine/llm_engine.py), which mixes
this in.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.block_allocator import OutOfBlocksError
from engine.config import SamplingParams
from engine.kv_group_tables import counts_text, group_page_ids, num_group_blocks_held
from engine.request import Request, Reservation
from engine.request_checks import check_fits_pool, check_prompt
from engine.types import PromptReservation, RequestOutput

if TYPE_CHECKING:
    from engine.config import CacheConfig, EngineConfig
    from engine.kv_cache import CopyOp
    from engine.kv_groups import KVGroups
    from engine.kv_pool import GroupedKVPool
    from engine.models.config import ModelConfig
    from engine.scheduler import Scheduler
    from engine.state_pool import StatePool


class GenerationSide:
    """Mixed into LLMEngine; what it uses of LLMEngine is declared here."""

    if TYPE_CHECKING:
        config: EngineConfig
        cache_config: CacheConfig
        model_config: ModelConfig
        kv_cache: KVGroups
        kv_pool: GroupedKVPool
        state_pool: StatePool | None
        scheduler: Scheduler
        _requests: dict[str, Request]
        _reservations: dict[str, Reservation]
        _ready_outputs: list[RequestOutput]

        def _check_new_request(
            self, request_id: str, prompt_ids: list[int], params: SamplingParams
        ) -> None: ...
        def _make_request(
            self, request_id: str, prompt_ids: list[int], params: SamplingParams, salt: bytes
        ) -> Request: ...
        def _free_slots(self, slot_ids: list[int]) -> None: ...
        def _copy_snapshots(self, copies: list[CopyOp]) -> None: ...
        def _finish(self, request: Request) -> RequestOutput: ...
        def _progress(self, request: Request) -> RequestOutput: ...

    def reserve_prompt(
        self, request_id: str, prompt_ids: list[int], salt: bytes = b"", params: SamplingParams | None = None
    ) -> PromptReservation:
        """Blocks for a prompt whose KV will be pulled. With `params`, the request's whole block
        bound must fit next to what the running requests and the other reservations may still
        take, and, for a hybrid model, its W state slots are taken now. Raises PoolTooSmallError
        when the bound exceeds the whole pool (it never fits), OutOfBlocksError when it does not
        fit now (a caller may retry later); either way nothing is held."""
        check_prompt(self.model_config, prompt_ids, 0 if params is None else params.max_new_tokens)
        if request_id in self._reservations or request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        cache, bound = self.kv_cache, tuple(0 for _ in self.kv_cache.groups)
        if params is not None:
            sizes = (len(prompt_ids), len(prompt_ids) + params.max_new_tokens, params.beam_width)
            # A pulled prompt arrives whole: no chunk, only the first decode query's window.
            needs = cache.blocks_needed(*sizes, chunk_tokens=0)
            check_fits_pool(request_id, f"up to {counts_text(needs)} blocks", sum(needs), cache.num_blocks())
            # Its prompt arrives whole: from the first step on it holds what decoding needs.
            bound = cache.blocks_needed(*sizes, is_decoding=True)
        # A refusal restores the counters too: a queued request retries, and must not count its
        # lookups each time.
        stats_before = replace(cache.stats)
        # Pulled pages overwrite whole blocks: copying a partly matched block would be wasted.
        # The prompt's final recurrent state comes with the pages: only the pages limit reuse here.
        # A sliding group takes only the pages the first decode query (at the prompt's end) sees.
        allocation = cache.allocate_prompt(
            prompt_ids, salt, allow_partial_reuse=False, prune_to_snapshots=False,
            first_query_position=len(prompt_ids),
        )  # fmt: skip
        self.kv_pool.copy_blocks(allocation.copies)
        new_blocks = cache.stats.new_blocks - stats_before.new_blocks
        table = allocation.table
        if params is not None:
            # Reservations still pulling grow once they join the batch: their bounds count too.
            reserved = [
                running + sum(held.remaining_blocks()[group] for held in self._reservations.values())
                for group, running in enumerate(self.scheduler.reserved_blocks())
            ]
            held_now = num_group_blocks_held([table], cache.num_groups)
            growth = [
                rest + max(0, need - have) for rest, need, have in zip(reserved, bound, held_now, strict=True)
            ]
            if not cache.fits(tuple(growth)):
                cache.free(table)
                cache.stats = stats_before
                raise OutOfBlocksError(
                    f"request {request_id!r} needs up to {counts_text(bound)} blocks; the pool is full "
                    f"({cache.num_free_blocks()} of {cache.num_blocks()} free, "
                    f"{counts_text(reserved)} promised to running and reserved requests)"
                )
        slot_ids: list[int] = []
        if params is not None and self.state_pool is not None:
            try:
                slot_ids = self.state_pool.allocate_slots(params.beam_width)
            except OutOfBlocksError:
                self.kv_cache.free(table)
                self.kv_cache.stats = stats_before
                raise
        self._reservations[request_id] = Reservation(
            table, list(prompt_ids), salt, new_blocks, slot_ids, bound if params is not None else (),
            allocation.full_attention_reusable_tokens, allocation.window_reusable_tokens,
        )  # fmt: skip
        cache.stats.window_pruned_tokens += (
            allocation.full_attention_reusable_tokens - allocation.num_cached_tokens
        )
        region_pages = self.kv_pool.region_pages
        positions, destinations = region_pages.pull_plan(
            table.group_block_ids(), allocation.num_cached_blocks
        )
        return PromptReservation(
            request_id, list(table.block_ids), allocation.num_cached_blocks, group_page_ids(table),
            positions, destinations, region_pages.num_prompt_pages(len(prompt_ids)),
        )  # fmt: skip

    def cancel_reservation(self, request_id: str) -> None:
        reservation = self._reservations.pop(request_id, None)
        if reservation is not None:
            self.kv_cache.free(reservation.table)
            self._free_slots(reservation.state_slot_ids)

    def add_prefilled_request(
        self,
        reservation: PromptReservation,
        prompt_ids: list[int],
        params: SamplingParams,
        candidate_ids: list[int],
        candidate_logprobs: list[float],
        recurrent_state: bytes = b"",
        candidate_model_logprobs: list[float] | None = None,
    ) -> None:
        """The reservation's blocks now hold the prompt's KV: expand to the beams and join the batch.
        The decoder starts from candidate_logprobs; scoring records candidate_model_logprobs (empty:
        the same numbers).

        A hybrid model also needs `recurrent_state`, the state after the whole prompt
        (PrefillResult.recurrent_state); it is installed in beam 0's slot before the beams expand.
        """
        request_id = reservation.request_id
        held = self._reservations.get(request_id)
        if held is None:
            raise KeyError(f"no reservation for request_id {request_id!r}")
        if list(prompt_ids) != held.prompt_ids:
            raise ValueError("prompt_ids differ from the reserved prompt")
        self._check_new_request(request_id, prompt_ids, params)
        request = self._make_request(request_id, prompt_ids, params, held.salt)
        # The decoder checks the candidates before anything else changes: a refusal leaves the
        # reservation as it was.
        first_step = request.active_decoder.start(list(candidate_ids), list(candidate_logprobs))
        if request.logprob_trie is not None:
            request.logprob_trie.record_candidates(
                list(candidate_ids), list(candidate_model_logprobs or candidate_logprobs)
            )
            request.logprob_trie.advance(first_step.parent_indices, first_step.token_ids, None)
        if self.state_pool is not None:
            if len(recurrent_state) != self.state_pool.state_bytes:
                raise ValueError(
                    f"recurrent_state must hold {self.state_pool.state_bytes} bytes, got {len(recurrent_state)}"
                )
            if len(held.state_slot_ids) != request.num_beams:
                # Reserved without params (or for another width); a refusal leaves it unchanged.
                fresh_slot_ids = self.state_pool.allocate_slots(request.num_beams)
                self._free_slots(held.state_slot_ids)
                held.state_slot_ids = fresh_slot_ids
            request.state_slot_ids = held.state_slot_ids
            self.state_pool.write(request.state_slot_ids[0], recurrent_state)
        del self._reservations[request_id]
        request.tables = [held.table]
        request.reused_tokens = reservation.num_cached_blocks * self.cache_config.tokens_per_block
        request.num_tokens_before_hybrid_pruning = request.reused_tokens
        request.full_attention_reusable_tokens = held.full_attention_reusable_tokens
        request.window_reusable_tokens = held.window_reusable_tokens
        request.new_blocks = held.new_blocks
        request.times.admitted = time.monotonic()
        snapshot_lens: list[int] = []
        if self.state_pool is not None:
            # The shipped state is the snapshot of the prompt's last block when the prompt ends it.
            prompt_len = len(request.prompt_ids)
            for num_tokens, block_id in self.kv_cache.prompt_snapshots(
                held.table, prompt_len - 1, prompt_len
            ):
                self.state_pool.save_snapshot(request.state_slot_ids[0], block_id)
                snapshot_lens.append(num_tokens)
        self._copy_snapshots(self.kv_cache.commit(held.table, request.prompt_ids, held.salt, snapshot_lens))
        self._requests[request_id] = request
        self.scheduler.add_running(request)
        request.record_step(first_step)
        # The first token leaves before the next forward pass, not with its result: a pulled
        # request's TTFT is the prefill plus the pull, as an aggregated one's is its prefill.
        self._ready_outputs.append(
            self._finish(request) if request.active_decoder.is_done else self._progress(request)
        )
