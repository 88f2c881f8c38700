"""Continuous batching: which requests run in the next forward pass, and their KV blocks.

Plain Python over the KV groups (engine/kv_groups.py); the model never appears here. Each `schedule()`:
1. grows every decoding request's tables for its pending step (reorder beams, one slot each),
   all or nothing per call, so a request short of blocks waits and resumes where it stopped;
2. spends the token budget (`max_num_batched_tokens`): one token per decoding beam first, then
   the next chunk of each prompt being prefilled: prompts whose rest fits in one step's budget
   first, then longer ones, oldest first within each; a prompt longer than what is left runs that
   much now and the rest in later steps (chunked prefill);
3. admits waiting requests first come first served while the batch has room for their beams
   (`max_num_seqs`) and the pool has room for their DESIGN.md block bound on top of what the
   running requests may still take:
   floor(P/T) + W * (ceil(S/T) - floor(P/T)) - reused blocks per full KV group (a sliding one:
   its window and one chunk while prefilling, W windows while decoding; docs/cache.md), and, for
   a hybrid model, W free recurrent-state slots. A sliding group takes each chunk's blocks when
   the chunk is scheduled (KVGroups.extend_for_chunk); short of them the chunk waits a step. An admitted prompt gets its first chunk in the same step if budget is
   left, else in a later one (it holds its blocks meanwhile, and no longer counts as queued);
4. sheds what the queue's `QueueLimits` do not allow: requests that waited too long, then the
   youngest past the queue's length bound (each fails with `request.error`, holding nothing).

A request's beams never depend on its neighbours: the batch only decides when a request
advances, never what it computes.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from engine.kv_cache import CopyOp, OutOfBlocksError
from engine.kv_group_tables import BlockCounts, GroupedAllocation, GroupedTable
from engine.kv_groups import KVGroups
from engine.request import Request, RequestState
from engine.state_pool import OutOfStateSlotsError, StatePool

Result = TypeVar("Result")


@dataclass(frozen=True)
class QueueLimits:
    """Bounds on the waiting queue (None: unbounded, the offline engine). Counted after admission,
    so a request that fits at once never counts against `max_num_waiting`."""

    max_num_waiting: int | None = None
    max_wait_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_num_waiting is not None and self.max_num_waiting < 0:
            raise ValueError(f"max_num_waiting must be >= 0, got {self.max_num_waiting}")
        if self.max_wait_s is not None and not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, got {self.max_wait_s}")


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens [start, start + num_tokens) of `request` run in this step's forward."""

    request: Request
    start: int  # the request's num_computed_tokens when scheduled
    num_tokens: int

    @property
    def is_last(self) -> bool:
        """The prompt is whole after this chunk: commit it, then decode (or pin, context side)."""
        return self.start + self.num_tokens == self.request.prompt_len


@dataclass
class ScheduledBatch:
    prefills: list[PrefillChunk] = field(default_factory=list)  # the next chunk of a prompt each
    decodes: list[Request] = field(default_factory=list)  # one new token per running beam
    failed: list[Request] = field(default_factory=list)  # dropped with request.error set, blocks freed

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass feeds: one per decoding beam, plus every prompt chunk."""
        num_decode_tokens = sum(len(request.tables) for request in self.decodes)
        return num_decode_tokens + sum(chunk.num_tokens for chunk in self.prefills)


class Scheduler:
    def __init__(
        self,
        kv_cache: KVGroups,
        max_num_seqs: int,
        copy_blocks: Callable[[tuple[list[CopyOp], ...]], None],
        state_pool: StatePool | None = None,
        max_num_batched_tokens: int | None = None,
        queue_limits: QueueLimits | None = None,
    ) -> None:
        """max_num_batched_tokens: the token budget of one forward pass (None: no limit, every
        prompt runs whole). copy_blocks takes one copy list per KV group."""
        self.kv_cache = kv_cache
        self.copy_blocks = copy_blocks
        self.queue_limits = queue_limits or QueueLimits()
        self.max_num_batched_tokens = max_num_batched_tokens
        # Hybrid models: request.state_slot_ids[i] holds running beam i's recurrent state.
        self.state_pool = state_pool
        self.max_num_seqs = max_num_seqs
        # Copies must reach the pool before any later allocation may hand out their source.
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # -- membership --------------------------------------------------------------------------
    def add_waiting(self, request: Request) -> None:
        self._set_formula(request)
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A request whose prompt KV is already in its table (generation side)."""
        self._set_formula(request)
        request.state = RequestState.DECODING
        request.num_computed_tokens = request.prompt_len
        self._note_blocks(request)
        self.running.append(request)

    def add_prefill_only(self, request: Request) -> None:
        """A context-side prompt, allocated now (OutOfBlocksError leaves nothing held, as a
        synchronous prefill always did; sliding groups: only the reused prefix's window, each
        chunk's blocks when it is scheduled) and run chunk by chunk in the following steps. It takes
        no admission turn: the context side never decodes, so it promises no growth. Its chunks'
        sliding blocks must fit next to what the running requests may still take, so that no
        prompt stalls part-way (else OutOfBlocksError, nothing held)."""
        self._set_formula(request)
        if self.state_pool is not None and self.state_pool.num_free_slots() < request.num_beams:
            raise OutOfStateSlotsError(
                f"need {request.num_beams} state slots, {self.state_pool.num_free_slots()} free"
            )
        before = self._stats_before()
        reserved = self.reserved_blocks()
        stats_before = replace(self.kv_cache.stats)
        allocation = self.kv_cache.allocate_prompt(
            request.prompt_ids, request.salt, reuse_prefix=not request.wants_prompt_logprobs, is_chunked=True
        )
        request.tables = [allocation.table]
        growth = request.remaining_blocks()
        # A prompt that grows no more holds what it needs; one whose chunks still take pages (its
        # sliding groups) must find them next to every running request's rest, in the shared pool.
        needed = tuple(map(sum, zip(reserved, growth, strict=True)))
        if any(growth) and not self.kv_cache.fits(needed):
            self.kv_cache.free(allocation.table)
            request.tables = []
            self.kv_cache.stats = stats_before
            raise OutOfBlocksError(
                f"prompt chunks need up to {list(growth)} more blocks per KV group, "
                f"{self.kv_cache.num_free_blocks()} free, {list(reserved)} promised"
            )
        self._install_prompt(request, allocation, before)
        request.state = RequestState.PREFILLING
        request.times.admitted = time.monotonic()
        self.running.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of the batch and free every block it holds."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        for table in request.tables:
            self.kv_cache.free(table)
        request.tables = []
        if self.state_pool is not None:
            self.state_pool.free_slots(request.state_slot_ids)
        request.state_slot_ids = []
        request.state = RequestState.FINISHED
        request.times.finished = time.monotonic()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def live_tables(self) -> Iterable[GroupedTable]:
        for request in self.running:
            yield from request.tables

    def live_slot_ids(self) -> Iterable[int]:
        for request in self.running:
            yield from request.state_slot_ids

    def num_running_beams(self) -> int:
        return sum(request.num_beams for request in self.running)

    # -- scheduling --------------------------------------------------------------------------
    def schedule(self, blocks_held_elsewhere: bool = False) -> ScheduledBatch:
        """blocks_held_elsewhere: pinned prompts or reservations that will be released on their
        own timers; while they exist a stuck batch waits for them instead of failing a request."""
        batch = ScheduledBatch()
        prefilling: list[Request] = []
        for request in list(self.running):
            if request.state is RequestState.PREFILLING:
                prefilling.append(request)  # admitted, its prompt not yet whole
            elif request.state is RequestState.DECODING and self._grow(request, batch):
                batch.decodes.append(request)
        # Decode tokens first: a beam never waits behind a prompt. Then the prompts whose rest fits
        # in one step's budget, then the longer ones, oldest first within each (a stable sort): a
        # long prompt's chunks hold a short prompt back one step at most, not until they are done.
        if self.max_num_batched_tokens is not None:
            budget = self.max_num_batched_tokens
            prefilling.sort(key=lambda request: request.num_uncomputed_tokens > budget)
        for request in prefilling:
            if self._prefill_budget(batch) == 0:
                break
            self._add_chunk(request, batch)
        self._admit(batch)
        self._shed_waiting(batch)
        if batch.is_empty and self.running and not blocks_held_elsewhere:
            # Nobody can advance and no block will come back on its own: rather than wait
            # forever, the youngest request gives its blocks up.
            self._fail(self.running[-1], "out of KV blocks: the pool cannot hold this request's beams", batch)
        return batch

    def _grow(self, request: Request, batch: ScheduledBatch) -> bool:
        """Apply the pending step to the request's tables; False if it must wait for blocks."""
        step = request.pending
        if step is None:
            return False
        try:
            if not request.is_reordered:
                tables, copies = self._counted(
                    request, lambda: self.kv_cache.reorder_beams(request.tables, step.parent_indices)
                )
                self.copy_blocks(copies)
                if self.state_pool is not None:
                    # A beam continuing a parent continues from the parent's state.
                    self.state_pool.fork(request.state_slot_ids, step.parent_indices)
                request.tables, request.is_reordered = tables, True
            while request.num_grown_tables < len(request.tables):
                table = request.tables[request.num_grown_tables]
                self._counted(request, functools.partial(self.kv_cache.append_slots, table, 1))
                request.num_grown_tables += 1
        except OutOfBlocksError:
            self._note_blocks(request)
            return False
        self._note_blocks(request)
        return True

    def _admit(self, batch: ScheduledBatch) -> None:
        # Admission is by blocks and beams only: a request admitted once the budget is spent holds
        # its prompt's blocks and gets its first chunk in a later step. (Gating it on the budget
        # too kept requests queued behind long prompts until the queue's wait bound refused them.)
        while self.waiting:
            request = self.waiting[0]
            if request.num_beams > self.max_num_seqs or not self.kv_cache.fits(
                request.formula_group_blocks, self.kv_cache.num_blocks()
            ):
                self.waiting.popleft()
                self._fail(request, self._too_large_message(request), batch)
                continue
            if self.num_running_beams() + request.num_beams > self.max_num_seqs:
                return
            if not self._try_allocate_prompt(request):
                return
            self.waiting.popleft()
            request.state = RequestState.PREFILLING
            request.times.admitted = time.monotonic()
            self.running.append(request)
            if self._prefill_budget(batch) > 0:
                self._add_chunk(request, batch)

    def _prefill_budget(self, batch: ScheduledBatch) -> int:
        """Prompt tokens this step may still feed."""
        if self.max_num_batched_tokens is None:
            return 1 << 62
        return max(0, self.max_num_batched_tokens - batch.num_tokens)

    def _add_chunk(self, request: Request, batch: ScheduledBatch) -> None:
        """The prompt's next chunk joins the batch once its sliding groups hold the chunk's blocks
        (KVGroups.extend_for_chunk); short of blocks, it waits for a later step."""
        num_tokens = min(request.num_uncomputed_tokens, self._prefill_budget(batch))
        end = request.num_computed_tokens + num_tokens
        try:
            self._counted(request, functools.partial(self.kv_cache.extend_for_chunk, request.tables[0], end))
        except OutOfBlocksError:
            return
        self._note_blocks(request)
        batch.prefills.append(PrefillChunk(request, request.num_computed_tokens, num_tokens))

    def _shed_waiting(self, batch: ScheduledBatch) -> None:
        """Fail waiting requests past the queue's bounds; they hold no block, so nothing is freed."""
        limits = self.queue_limits
        if limits.max_wait_s is not None:
            now = time.monotonic()
            for request in list(self.waiting):
                waited_s = now - request.times.arrival
                if waited_s > limits.max_wait_s:
                    message = (
                        f"waited {waited_s:.1f} s in the queue for KV blocks or batch room "
                        f"(max_queue_wait_s {limits.max_wait_s:g})"
                    )
                    self.waiting.remove(request)
                    self._fail(request, message, batch)
        if limits.max_num_waiting is not None:
            while len(self.waiting) > limits.max_num_waiting:
                request = self.waiting.pop()  # the youngest: the queue is first come first served
                message = (
                    f"queue full: {limits.max_num_waiting} requests already wait for KV blocks or "
                    f"batch room (max_queued_requests {limits.max_num_waiting})"
                )
                self._fail(request, message, batch)

    def _try_allocate_prompt(self, request: Request) -> bool:
        if self.state_pool is not None and self.state_pool.num_free_slots() < request.num_beams:
            return False
        reserved = self.reserved_blocks()
        stats = self.kv_cache.stats
        before = self._stats_before()
        try:
            allocation = self.kv_cache.allocate_prompt(
                request.prompt_ids, request.salt, reuse_prefix=not request.wants_prompt_logprobs,
                is_chunked=True,
            )  # fmt: skip
        except OutOfBlocksError:
            return False
        request.tables = [allocation.table]
        growth = request.remaining_blocks()
        if not self.kv_cache.fits(tuple(map(sum, zip(reserved, growth, strict=True)))):
            # Not enough room for this request's bound next to the running ones' bounds.
            self.kv_cache.free(allocation.table)
            request.tables = []
            (
                stats.prompt_tokens, stats.reused_tokens, stats.new_blocks, stats.copied_blocks,
                stats.hybrid_pruned_tokens,
            ) = before  # fmt: skip
            return False
        self._install_prompt(request, allocation, before)
        return True

    def _stats_before(self) -> tuple[int, int, int, int, int]:
        stats = self.kv_cache.stats
        return (
            stats.prompt_tokens, stats.reused_tokens, stats.new_blocks, stats.copied_blocks,
            stats.hybrid_pruned_tokens,
        )  # fmt: skip

    def reserved_blocks(self) -> BlockCounts:
        """Per KV group, the blocks the running requests may still take (their bounds' rest)."""
        total = [0] * self.kv_cache.num_groups
        for other in self.running:
            for group, count in enumerate(other.remaining_blocks()):
                total[group] += count
        return tuple(total)

    def _install_prompt(
        self, request: Request, allocation: GroupedAllocation, before: tuple[int, int, int, int, int]
    ) -> None:
        """The request takes its allocated prompt table (and, hybrid, its state slots)."""
        stats = self.kv_cache.stats
        request.tables = [allocation.table]
        self.copy_blocks(allocation.copies)
        # The first chunk's queries start after the reused prefix: what they cannot see goes.
        self.kv_cache.release_out_of_window(allocation.table, allocation.num_cached_tokens)
        if self.state_pool is not None:
            # Loaded now, before any later allocation may evict the snapshot's block.
            request.state_slot_ids = self.state_pool.allocate_slots(request.num_beams)
            self.state_pool.reset(request.state_slot_ids[0], allocation.snapshot_block_id)
        request.num_tokens_before_hybrid_pruning = allocation.num_tokens_before_hybrid_pruning
        request.full_attention_reusable_tokens = allocation.full_attention_reusable_tokens
        request.window_reusable_tokens = allocation.window_reusable_tokens
        # Counted once admitted (a refused allocation is retried and must not count twice).
        self.kv_cache.stats.window_pruned_tokens += (
            allocation.full_attention_reusable_tokens - allocation.num_cached_tokens
        )
        request.num_cached_tokens = allocation.num_cached_tokens
        request.num_computed_tokens = allocation.num_cached_tokens
        request.reused_tokens = allocation.num_cached_tokens
        request.new_blocks += stats.new_blocks - before[2]
        request.copied_blocks += stats.copied_blocks - before[3]
        self._note_blocks(request)

    def _fail(self, request: Request, message: str, batch: ScheduledBatch) -> None:
        request.error = message
        self.remove(request)
        batch.failed.append(request)

    def check_integrity(self) -> None:
        """The batch's own invariants (the cache checks its reference counts separately)."""
        for request in self.waiting:
            assert not request.tables, f"waiting request {request.request_id} holds blocks"
        for request in self.running:
            assert request.state in (RequestState.PREFILLING, RequestState.DECODING), request.request_id
            assert request.tables, f"running request {request.request_id} holds no table"
            if request.state is RequestState.PREFILLING:
                # One prompt table of the whole prompt; its chunks run from the cached tokens on.
                assert len(request.tables) == 1 and request.num_steps == 0, request.request_id
                assert request.num_cached_tokens <= request.num_computed_tokens < request.prompt_len, (
                    f"{request.request_id}: {request.num_computed_tokens} of {request.prompt_len} computed"
                )
            else:
                assert not request.is_prefill_only, f"prefill-only {request.request_id} is decoding"
                assert request.num_computed_tokens == request.prompt_len, request.request_id
            # Beams move in lockstep: k decided tokens means k - 1 fed (k once grown for the next).
            fed = request.prompt_len + max(request.num_steps - 1, 0)
            assert all(table.num_tokens in (fed, fed + 1) for table in request.tables), request.request_id
            if request.state is RequestState.PREFILLING:
                # Sliding groups hold the prompt up to the chunk that runs next, at least what ran.
                assert all(
                    group_table.num_tokens >= request.num_computed_tokens
                    for group_table in request.tables[0].tables
                ), request.request_id
            assert request.peak_blocks <= request.formula_blocks, f"{request.request_id} exceeds its bound"
            bound = (
                request.decode_group_blocks
                if request.state is RequestState.DECODING
                else request.formula_group_blocks
            )
            held = request.num_group_blocks_held()
            assert all(have <= need for have, need in zip(held, bound, strict=True)), (
                f"{request.request_id} holds {held} blocks per KV group, its bound is {bound}"
            )
            if self.state_pool is not None:
                assert len(request.state_slot_ids) == request.num_beams, f"{request.request_id} state slots"

    # -- bookkeeping -------------------------------------------------------------------------
    def _set_formula(self, request: Request) -> None:
        max_new_tokens = 0 if request.is_prefill_only else request.params.max_new_tokens
        total_len = request.prompt_len + max_new_tokens
        # Prompts run in chunks of at most max_num_batched_tokens (None: whole).
        request.formula_group_blocks = self.kv_cache.blocks_needed(
            request.prompt_len, total_len, request.num_beams, chunk_tokens=self.max_num_batched_tokens
        )
        request.decode_group_blocks = self.kv_cache.blocks_needed(
            request.prompt_len, total_len, request.num_beams, is_decoding=True
        )
        request.formula_blocks = sum(request.formula_group_blocks)

    def _too_large_message(self, request: Request) -> str:
        if request.num_beams > self.max_num_seqs:
            return f"beam_width {request.num_beams} exceeds max_num_seqs {self.max_num_seqs}"
        if self.kv_cache.num_groups == 1:
            return (
                f"request needs up to {request.formula_blocks} KV blocks, the pool has "
                f"{self.kv_cache.num_blocks()}"
            )
        return (
            f"request needs up to {list(request.formula_group_blocks)} KV blocks per group "
            f"({request.formula_blocks} in all), the shared pool has {self.kv_cache.num_blocks()}"
        )

    def _counted(self, request: Request, operation: Callable[[], Result]) -> Result:
        stats = self.kv_cache.stats
        new_before, copied_before = stats.new_blocks, stats.copied_blocks
        result = operation()
        request.new_blocks += stats.new_blocks - new_before
        request.copied_blocks += stats.copied_blocks - copied_before
        return result

    @staticmethod
    def _note_blocks(request: Request) -> None:
        request.peak_blocks = max(request.peak_blocks, request.num_blocks_held())
