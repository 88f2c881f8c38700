"""LLMEngine: the model, the paged KV cache and the continuous batch behind one object.

Three ways in, one loop (`step`, one forward pass under the token budget):
- aggregated: `add_request` -> prefill in the batch, chunk by chunk -> beams -> `step` until
  finished;
- context side (engine/context_side.py, mixed in): `add_prefill` allocates a prompt now; `step`
  runs it in chunks next to other prompts, then commits and pins its blocks and emits its
  first-step candidates (`RequestOutput.prefill`); `prefill` does the same for one prompt,
  synchronously; `release_prefill` unpins;
- generation side: `reserve_prompt` allocates the prompt's blocks (sharing what this engine's
  tree holds), the caller pulls the missing pages into them, `add_prefilled_request` starts
  decoding from the shipped candidates.
Both decoding paths start from the same candidates, so their beams are identical.
A hybrid model (LFM2) also carries a recurrent state per beam (engine/state_pool.py): the context
side returns the prompt's final state with the candidates, the generation side installs it.

Not thread-safe: one thread owns the engine. See docs/engine.md for the request lifecycle.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace

import torch

from engine.batch_invariant import make_batch_invariant
from engine.config import EngineConfig, SamplingParams
from engine.context_side import ContextSide
from engine.fused_projections import fuse_packed_projections, fusion_checks
from engine.generation_side import GenerationSide
from engine.heap import trim_heap
from engine.kernel_facts import CHILD_MIN_ELEMENTS, CheckChild
from engine.kv_cache import CopyOp
from engine.kv_group_tables import GroupedTable
from engine.kv_groups import KVGroups
from engine.kv_pool import GroupedKVPool
from engine.logprobs import LogprobTrie
from engine.model_runner import ModelRunner, SequenceInput
from engine.models.config import ModelConfig
from engine.models.decoder import use_native_activation, use_native_rotary
from engine.models.loader import load_model
from engine.models.norms import use_native_norms
from engine.native_kernels import add_norm_kernel, decode_kernel, norm_kernel, rotary_kernel, silu_mul_kernel
from engine.packed_linear import (
    CHECK_MODULES,
    checks_in_child,
    collapse_packed_weights,
    linear_checks,
    warm_up_linear_layers,
)
from engine.request import Request, RequestState, Reservation, make_decoder, step_decoders
from engine.request_checks import check_params, check_prompt
from engine.sampling import candidates_from_logprobs
from engine.scheduler import QueueLimits, Scheduler
from engine.state_pool import StatePool
from engine.stop_strings import StopStringMatcher
from engine.types import EngineCounters, KVRegion, RequestOutput, TokenLogprob

logger = logging.getLogger(__name__)


class LLMEngine(ContextSide, GenerationSide):
    def __init__(
        self, config: EngineConfig, queue_limits: QueueLimits | None = None, warm_up: bool = True
    ) -> None:
        """queue_limits: bounds on the scheduler's waiting queue (a server's; None: unbounded).
        warm_up=False: the caller calls warm_up() before serving, from the thread that will step
        the engine (its torch thread count is the one the kernel checks are for); the checks'
        child process started during the load waits for that call."""
        self._check_child: CheckChild | None = None
        # Whether this engine's kernel checks run in a child (decided once, at the config)
        self._checks_in_child = False
        try:
            self._build(config, queue_limits)
            if warm_up:
                self.warm_up()
        except BaseException:
            if self._check_child is not None:  # not asked: an error before the warm-up
                self._check_child.close()
                self._check_child = None
            raise

    def _build(self, config: EngineConfig, queue_limits: QueueLimits | None) -> None:
        """The model, the KV pool and cache, the runner and the scheduler."""
        # A tied embedding's dense copy goes where packing puts the head (engine/packed_linear.py).
        compact = config.batch_invariant and torch.device(config.device).type == "cpu"
        # The kernel checks' child process starts as soon as the model's shapes are known, so its
        # start-up overlaps the weights' loading (engine/kernel_facts.py).
        model, self.model_config, self.tokenizer = load_model(
            config.model,
            config.dtype,
            config.device,
            compact_tied_embedding=compact,
            on_config=lambda model_config: self._start_check_child(model_config, compact),
        )
        if config.batch_invariant:
            # Every kernel check and weight packing now, before anyone calls this engine ready:
            # not on the first request (engine/packed_linear.py).
            make_batch_invariant(model)
        # A hybrid model keeps one state snapshot per block next to its page (engine/state_pool.py).
        layout = GroupedKVPool.build(
            self.model_config, config.cache, model.dtype, config.device,
            StatePool.state_bytes_for(self.model_config, model.dtype),
        )  # fmt: skip
        cache_config = layout.cache_config
        self.config = replace(config, cache=cache_config)  # the pool size found at run time
        # One page: a KV group's S layers (every layer with one group), and a hybrid's snapshot.
        self.page_bytes = layout.page_bytes
        self.cache_config = cache_config
        self.kv_pool = layout.pool
        self.kv_cache = KVGroups(cache_config, layout.groups, self.model_config.is_hybrid)
        self.state_pool: StatePool | None = None
        if self.model_config.is_hybrid:
            # One slot per running beam (max_num_seqs of them) plus as many for prompts being
            # prefilled on the context side.
            self.state_pool = StatePool(
                self.model_config,
                2 * config.max_num_seqs,
                cache_config.num_blocks,
                model.dtype,
                config.device,
            )
        windows = [group.window for group in layout.groups]
        native = config.native_kernels and torch.device(config.device).type == "cpu"
        norm = norm_kernel() if native else None
        if norm is not None:
            use_native_norms(model, norm, add_norm_kernel())
        activation = silu_mul_kernel() if native else None
        if activation is not None:
            use_native_activation(model, activation)
        rotary = rotary_kernel() if native else None
        if rotary is not None:
            use_native_rotary(model, rotary)
        native_attention = native and config.batch_invariant and decode_kernel() is not None
        self.runner = ModelRunner(
            model, self.kv_pool, self.state_pool, config.batch_invariant, windows, native_attention
        )
        self.scheduler = Scheduler(
            self.kv_cache,
            config.max_num_seqs,
            self.kv_pool.copy_blocks,
            self.state_pool,
            config.max_num_batched_tokens,
            queue_limits,
        )
        self._requests: dict[str, Request] = {}
        self._prefilled: dict[str, GroupedTable] = {}  # context side: pinned prompts
        self._reservations: dict[str, Reservation] = {}  # generation side: awaiting their pull
        self._ready_outputs: list[RequestOutput] = []  # decided outside step(), sent by the next one
        self._request_counter = itertools.count()

    def _start_check_child(self, model_config: ModelConfig, packs: bool) -> None:
        """Decides whether the kernel checks run in a child: where this engine packs its linear
        layers and the LM head (the largest linear layer of every family here) is large enough for
        the checks' memory to matter (engine/kernel_facts.py); starts it then. A warm-up that finds
        no child waiting (a second one, at another thread count) starts its own."""
        self._checks_in_child = (
            packs and model_config.vocab_size * model_config.hidden_size >= CHILD_MIN_ELEMENTS
        )
        if self._checks_in_child:
            try:
                self._check_child = CheckChild(CHECK_MODULES)
            except OSError as error:
                logger.warning("no child process for the kernel checks (%s): they run here", error)

    def warm_up(self) -> float:
        """Runs every per-shape kernel check at this thread's torch thread count and packs the
        linear weights (engine/packed_linear.py), so that no request pays for them; returns the
        seconds it took. Called by the constructor unless told not to; a caller that steps the
        engine from a thread with another thread count calls it from that thread before
        reporting ready."""
        started = time.monotonic()
        check_child, self._check_child = self._check_child, None  # the load's, asked once
        if self.config.batch_invariant:
            model, num_threads = self.runner.model, torch.get_num_threads()
            # The checks in a child process first: their primitives and banks leave with it
            # (engine/kernel_facts.py); the warm-up then finds every answer known.
            checks = linear_checks(model, num_threads) + fusion_checks(model, num_threads)
            checks_in_child(checks, check_child, start=self._checks_in_child)
            warm_up_linear_layers(model)
            fuse_packed_projections(model)
            collapse_packed_weights(model)
        # The de-quantized source tensors, the dense weights packing replaced and the checks'
        # random matrices are freed by now; hand their pages back (engine/heap.py).
        trim_heap()
        return time.monotonic() - started

    # -- aggregated --------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, salt: bytes = b""
    ) -> None:
        self._check_new_request(request_id, prompt_ids, params)
        request = self._make_request(request_id, prompt_ids, params, salt)
        self._requests[request_id] = request
        self.scheduler.add_waiting(request)

    def step(self) -> list[RequestOutput]:
        """Admit, grow, run one forward pass over the batch, advance every decoder in it.

        Outputs decided outside step() (a pulled request's first token) are returned first, alone,
        without a forward pass: the caller sends them and steps again."""
        outputs, self._ready_outputs = self._ready_outputs, []
        if outputs:
            return outputs
        batch = self.scheduler.schedule(blocks_held_elsewhere=bool(self._prefilled or self._reservations))
        outputs.extend(self._finish(request) for request in batch.failed)
        seqs = [self._chunk_input(chunk.request, chunk.num_tokens) for chunk in batch.prefills]
        for request in batch.decodes:
            assert request.pending is not None
            # Beam i feeds its pending token at the slot just grown: position num_tokens - 1.
            slot_ids: list[int | None] = list(request.state_slot_ids) or [None] * len(request.tables)
            num_beams = len(request.tables)  # one matmul item in batch-invariant mode
            seqs.extend(
                SequenceInput(
                    table.block_ids,
                    table.num_tokens - 1,
                    [token_id],
                    slot_id,
                    is_decode=True,
                    num_beams=num_beams,
                    group_block_ids=table.group_block_ids(),
                )
                for table, token_id, slot_id in zip(
                    request.tables, request.pending.token_ids, slot_ids, strict=True
                )
            )
        if not seqs:
            return outputs
        forward = self.runner.forward(seqs)
        logprobs = forward.logprobs  # [B, V] float32: the decoders'
        model_logprobs = forward.model_logprobs  # [B, V] report_dtype: the records'
        started: list[Request] = []
        for row, chunk in enumerate(batch.prefills):
            request = chunk.request
            request.num_computed_tokens = chunk.start + chunk.num_tokens
            request.prompt_scores.extend(forward.scores[row])
            if not chunk.is_last:
                # The logits of a chunk's last token are not needed; more chunks follow. Its full
                # blocks are published now, so a prompt admitted meanwhile reuses them.
                self._commit_prompt(request, request.num_computed_tokens)
                continue
            if request.is_prefill_only:
                result = self._complete_prefill(request, logprobs[row], model_logprobs[row])
                outputs.append(
                    RequestOutput(request.request_id, [], True, stats=request.stats(), prefill=result)
                )
                continue
            self._commit_prompt(request)
            self._start_decoding(request, logprobs[row], model_logprobs[row])
            started.append(request)
        row = len(batch.prefills)
        num_rows = [len(request.tables) for request in batch.decodes]
        steps = step_decoders(
            [request.active_decoder for request in batch.decodes],
            num_rows,
            logprobs[row : row + sum(num_rows)],
        )
        for request, num_beams, step in zip(batch.decodes, num_rows, steps, strict=True):
            rows = logprobs[row : row + num_beams]  # [W, V]
            if request.logprob_trie is not None:  # beam search draws its 2W from each row's best 2W
                request.logprob_trie.follow(rows, model_logprobs[row : row + num_beams], 2 * num_beams, step)
            request.record_step(step)
            row += num_beams
        for request in started + batch.decodes:
            is_done = request.active_decoder.is_done
            outputs.append(self._finish(request) if is_done else self._progress(request))
        return outputs

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is (queued, running, part-way through its prefill, pinned or
        reserved); frees its blocks."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.scheduler.remove(request)
        self.release_prefill(request_id)
        self.cancel_reservation(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._ready_outputs)

    @property
    def has_ready_outputs(self) -> bool:
        """The next step() only returns outputs decided outside it (a pulled request's first
        token): no forward pass, no need of the cores."""
        return bool(self._ready_outputs)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
        """Runs one request to completion (offline). Other requests in the engine advance too."""
        request_id = f"generate-{next(self._request_counter)}"
        self.add_request(request_id, prompt_ids, params)
        while True:
            for output in self.step():
                if output.request_id == request_id and output.finished:
                    return output

    # -- pool --------------------------------------------------------------------------------
    def kv_region(self) -> KVRegion:
        """The transfer region: the one pool every KV group's pages lie in."""
        return self.kv_pool.region()

    def num_blocks_in_use(self) -> int:
        return self.kv_cache.num_blocks_in_use()

    def counters(self) -> EngineCounters:
        stats = self.kv_cache.stats
        return EngineCounters(
            num_blocks_total=self.kv_cache.num_blocks(),
            num_blocks_in_use=self.kv_cache.num_blocks_in_use(),
            num_blocks_cached=self.kv_cache.num_blocks_cached(),
            num_waiting_requests=len(self.scheduler.waiting),
            num_running_requests=len(self.scheduler.running),
            prompt_tokens=stats.prompt_tokens,
            reused_tokens=stats.reused_tokens,
            beam_tail_copies=stats.beam_copied_blocks,
            partial_reuse_copies=stats.copied_blocks - stats.beam_copied_blocks,
            hybrid_pruned_tokens=stats.hybrid_pruned_tokens,
            window_pruned_tokens=stats.window_pruned_tokens,
            group_names=self.kv_cache.kind_names(),
            group_blocks_total=tuple(self.kv_cache.num_blocks() for _ in self.kv_cache.kind_names()),
            group_blocks_in_use=self.kv_cache.num_kind_blocks_in_use(),
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        for request in self._requests.values():
            if request.logprob_trie is not None:
                request.logprob_trie.check_integrity()
        tables = list(self.scheduler.live_tables())
        tables.extend(self._prefilled.values())
        tables.extend(reservation.table for reservation in self._reservations.values())
        self.kv_cache.check_integrity(tables)
        if self.state_pool is not None:
            slot_ids = list(self.scheduler.live_slot_ids())
            slot_ids.extend(
                slot for reservation in self._reservations.values() for slot in reservation.state_slot_ids
            )
            self.state_pool.check_integrity(slot_ids)

    # -- prompts and recurrent state -----------------------------------------------------------
    def _chunk_input(self, request: Request, num_tokens: int) -> SequenceInput:
        """The prompt's next chunk: tokens [num_computed_tokens, + num_tokens).

        A hybrid model carries the state in the request's slot from chunk to chunk and stores a
        snapshot at each block end the chunk computes (so chunks give the snapshots a whole pass
        would).
        """
        table, start = request.tables[0], request.num_computed_tokens
        end = start + num_tokens
        new_ids = request.prompt_ids[start:end]
        targets, num_top = request.score_targets(start, end), request.params.prompt_logprobs or 0
        if self.state_pool is None:
            return SequenceInput(
                table.block_ids, start, new_ids, score_target_ids=targets, score_num_top=num_top,
                group_block_ids=table.group_block_ids(),
            )  # fmt: skip
        snapshots = [
            (position, block_id)
            for position, block_id in self._prompt_snapshots(request)
            if start < position <= end
        ]
        return SequenceInput(
            table.block_ids, start, new_ids, request.state_slot_ids[0], snapshots,
            score_target_ids=targets, score_num_top=num_top,
        )  # fmt: skip

    def _prompt_snapshots(self, request: Request) -> list[tuple[int, int]]:
        """(num_tokens, block_id) of every snapshot the prefill of the uncached tokens stores."""
        return self.kv_cache.prompt_snapshots(
            request.tables[0], request.num_cached_tokens, request.prompt_len
        )

    def _commit_prompt(self, request: Request, num_tokens: int | None = None) -> None:
        """Publish the prompt's KV with the snapshots its chunks stored: all of it once it is all
        written, or, part-way (`num_tokens` computed so far), the whole blocks written so far.

        Those blocks' KV is final: the later chunks only write the blocks after them, and a token's
        KV does not depend on the chunk it was computed in (batch invariance). So a prompt sharing
        the prefix, admitted while this one is still in its chunks, reuses them instead of
        computing the prefix again. Commit is idempotent: the final commit publishes them again as
        no-ops. Then a sliding group releases the (published) blocks that the next queries, from
        num_computed_tokens on, cannot see (a pinned context-side prompt ships only its window)."""
        prompt_ids = request.prompt_ids
        if num_tokens is not None:
            num_tokens -= num_tokens % self.cache_config.tokens_per_block
            prompt_ids = prompt_ids[:num_tokens]
        if len(prompt_ids) > request.num_cached_tokens or num_tokens is None:
            snapshot_lens: list[int] = []
            if self.state_pool is not None:
                snapshot_lens = [
                    length for length, _ in self._prompt_snapshots(request) if length <= len(prompt_ids)
                ]
            self._copy_snapshots(
                self.kv_cache.commit(request.tables[0], prompt_ids, request.salt, snapshot_lens)
            )
        self.kv_cache.release_out_of_window(request.tables[0], request.num_computed_tokens)

    def _copy_snapshots(self, copies: list[CopyOp]) -> None:
        for copy in copies:
            assert self.state_pool is not None
            self.state_pool.copy_snapshot(copy.src_block, copy.dst_block)

    def _free_slots(self, slot_ids: list[int]) -> None:
        if self.state_pool is not None:
            self.state_pool.free_slots(slot_ids)

    # -- internals ---------------------------------------------------------------------------
    def _make_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, salt: bytes
    ) -> Request:
        eos_token_id = None if params.ignore_eos else params.eos_token_id
        if eos_token_id is None and not params.ignore_eos:
            eos_token_id = self.tokenizer.eos_token_id
        seed = (
            params.seed
            if params.seed is not None
            else self.config.seed * 1_000_003 + next(self._request_counter)
        )
        stop_matcher = StopStringMatcher(self.tokenizer, params.stop_strings) if params.stop_strings else None
        decoder = make_decoder(params, eos_token_id, seed, stop_matcher)
        request = Request(request_id, list(prompt_ids), params, decoder, salt)
        if params.logprobs is not None:
            request.logprob_trie = LogprobTrie(params.logprobs)
        return request

    def _start_decoding(self, request: Request, logprobs: torch.Tensor, model_logprobs: torch.Tensor) -> None:
        """logprobs: [V] float32 of the last prompt position (model_logprobs: in report_dtype); the
        same candidates a context worker ships."""
        candidate_ids, candidate_logprobs = candidates_from_logprobs(logprobs, request.params.num_candidates)
        request.state = RequestState.DECODING
        step = request.active_decoder.start(candidate_ids, candidate_logprobs)
        if request.logprob_trie is not None:
            num_kept = 2 * request.params.beam_width
            request.logprob_trie.follow(logprobs[None], model_logprobs[None], num_kept, step)
        request.record_step(step)

    def _progress(self, request: Request) -> RequestOutput:
        deltas, parents = request.take_deltas()
        trie = request.logprob_trie
        records = trie.take_streamed(deltas) if trie is not None else []
        return RequestOutput(request.request_id, deltas, False, parent_indices=parents, new_logprobs=records)

    def _finish(self, request: Request) -> RequestOutput:
        self._requests.pop(request.request_id, None)
        self.scheduler.remove(request)
        if request.error is not None:
            return RequestOutput(request.request_id, [], True, stats=request.stats(), error=request.error)
        # The last step's running beams are not the answer: the final output carries whole beams.
        request.take_deltas()
        beams = request.active_decoder.final_beams()
        trie = request.logprob_trie
        if trie is not None:
            beams = [replace(beam, logprobs=trie.walk(beam.token_ids)) for beam in beams]
        prompt_logprobs: list[TokenLogprob | None] | None = None
        if request.wants_prompt_logprobs:
            prompt_logprobs = [None, *request.prompt_scores]
        return RequestOutput(
            request.request_id, [], True, beams, request.stats(), prompt_logprobs=prompt_logprobs
        )

    def _check_new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        check_params(self.config, self.model_config, params)
        check_prompt(self.model_config, prompt_ids, params.max_new_tokens)
