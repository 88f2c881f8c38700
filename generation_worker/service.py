"""The generation worker's logic, free of gRPC: take over a prefilled prompt and decode W beams.

Order, and why:
1. `reserve_prompt`: match this engine's own prefix tree, allocate only the missing pages, with
   the request's whole block bound checked against the pool. A request that does not fit now
   waits in the worker's bounded admission queue (beamsplit/server/admission_queue.py) while
   heartbeats keep the context worker's hold alive; one that never fits, a full queue or a wait
   past its bound is RESOURCE_EXHAUSTED, and the coordinator may try another worker.
2. Pull exactly the missing pages from the context worker (heartbeats keep its lease alive).
3. Only then `add_prefilled_request`: the prompt expands to W beams inside the engine, so the
   prompt crossed the wire once whatever W is. The engine thread, told the add is coming
   (`EngineLoop.expect_command`, made with the reservation), waits for it at the step boundary
   that follows (bounded), so the request joins that step instead of the one after it.
4. Tell the context worker to release: its pages are no longer needed once ours are filled (the
   call runs while the add waits for the engine thread, and never holds the add up).
5. Stream the engine's outputs.
Any exit before the end (cancel, deadline, pull failure, shutdown) undoes exactly what was done:
cancel the reservation or abort the request, and release the context worker's hold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import grpc

from beamsplit.server.admission_queue import AdmissionLimits, AdmissionQueue, AdmissionRefusedError
from beamsplit.server.engine_loop import EngineLoop, ExpectedCommand, follow_stream
from beamsplit.server.metrics import ServerMetrics
from beamsplit.server.server_common import SHUTDOWN_MESSAGE, ShutdownGate
from beamsplit.v1 import worker_pb2
from beamsplit.wire import PULLED_REASON, ServiceError
from engine.block_allocator import OutOfBlocksError, PoolTooSmallError
from engine.config import SamplingParams
from engine.region_pages import RegionPages
from engine.types import PromptReservation, RequestOutput
from generation_worker.context_client import ContextClient
from transfer import PullHandle, TransferAgent, TransferStatus

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1


@dataclass(frozen=True)
class LocalLayout:
    region_name: str
    tokens_per_block: int
    page_bytes: int
    dtype: str
    model: str
    # How many region pages a prompt takes (KV groups: the windows' pages only); None: one a block.
    region_pages: RegionPages | None = None


@dataclass(frozen=True)
class GenerationTimeouts:
    engine_s: float = 120.0  # one engine command (reserve, add, abort)
    pull_s: float = 30.0  # the whole pull
    heartbeat_interval_s: float = 5.0  # how often the context worker's lease is extended
    lease_extend_s: float = 30.0
    output_s: float = 120.0  # silence from the engine before the request is failed


@dataclass(frozen=True)
class PullResult:
    num_blocks: int
    num_bytes: int
    transfer_ms: float


class GenerationService:
    def __init__(
        self,
        loop: EngineLoop,
        agent: TransferAgent,
        layout: LocalLayout,
        context_client: ContextClient,
        metrics: ServerMetrics,
        gate: ShutdownGate,
        timeouts: GenerationTimeouts,
        pull_delay_s: float = 0.0,  # a test hook (beamsplit/server/fault_hooks.py)
        admission: AdmissionLimits | None = None,
    ) -> None:
        self._pull_delay_s = pull_delay_s
        self.admission = AdmissionQueue(
            admission or AdmissionLimits(), "KV blocks on this generation worker", metrics.set_queued_requests
        )
        self._loop = loop
        self._agent = agent
        self._layout = layout
        self._context_client = context_client
        self._metrics = metrics
        self._gate = gate
        self._timeouts = timeouts
        self._cancel_events: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            events = [event for key, event in self._cancel_events.items() if key.split("#")[0] == request_id]
        for event in events:
            event.set()
        return bool(events)

    def generate(
        self,
        handoff: worker_pb2.Handoff,
        prompt_ids: list[int],
        params: SamplingParams,
        salt: bytes,
        is_client_gone: Callable[[], bool],
    ) -> Generator[RequestOutput, None, None]:
        self._check_handoff(handoff, prompt_ids)
        engine_request_id = f"{handoff.request_id}#{handoff.attempt}"
        cancelled = threading.Event()
        with self._lock:
            self._cancel_events[engine_request_id] = cancelled

        def stop_reason() -> ServiceError | None:
            if self._gate.is_aborting:
                return ServiceError(grpc.StatusCode.UNAVAILABLE, f"generation worker: {SHUTDOWN_MESSAGE}")
            if cancelled.is_set() or is_client_gone():
                return ServiceError(grpc.StatusCode.CANCELLED, "generation worker: request cancelled")
            return None

        stream = self._loop.open_stream(engine_request_id)
        is_finished = is_released = False
        release_reason = "failed"
        try:
            reservation, joining = self._reserve(
                engine_request_id, handoff, prompt_ids, params, salt, stop_reason
            )
            try:
                pull = self._pull(handoff, reservation, stop_reason)
                added = joining.submit(
                    lambda engine: engine.add_prefilled_request(
                        reservation,
                        prompt_ids,
                        params,
                        list(handoff.candidate_ids),
                        list(handoff.candidate_logprobs),
                        bytes(handoff.recurrent_state),  # hybrid: installed before the beams expand
                        list(handoff.candidate_model_logprobs),
                    )
                )
            finally:
                joining.cancel()
            # Our pages are filled: the context worker's may go (while the add waits its turn).
            self._context_client.release(handoff.context_address, handoff.transfer_id, PULLED_REASON)
            is_released = True
            self._loop.result(added, self._timeouts.engine_s)
            reused_tokens = min(
                len(prompt_ids), reservation.num_cached_blocks * self._layout.tokens_per_block
            )
            for output in follow_stream(stream, stop_reason, self._timeouts.output_s):
                if output.finished:
                    is_finished = True
                    output.stats.update(
                        generation_reused_tokens=reused_tokens,
                        transferred_blocks=pull.num_blocks,
                        transferred_bytes=pull.num_bytes,
                        transfer_ms=pull.transfer_ms,
                    )
                yield output
                if output.finished:
                    return
        except ServiceError as error:
            release_reason = error.message
            raise
        finally:
            if not is_released:
                self._context_client.release(handoff.context_address, handoff.transfer_id, release_reason)
            if not is_finished:
                # abort drops the request wherever it is (reserved or decoding) and is a no-op for
                # an unknown id, so it also covers an engine call that timed out but ran later.
                self._loop.submit(lambda engine: engine.abort(engine_request_id))
            self._loop.close_stream(engine_request_id)
            with self._lock:
                self._cancel_events.pop(engine_request_id, None)

    def _reserve(
        self,
        engine_request_id: str,
        handoff: worker_pb2.Handoff,
        prompt_ids: list[int],
        params: SamplingParams,
        salt: bytes,
        stop_reason: Callable[[], ServiceError | None],
    ) -> tuple[PromptReservation, ExpectedCommand]:
        """The request's blocks, now or after a bounded wait in the admission queue, and the
        engine thread's expectation of the add that follows the pull."""

        def reserve_and_expect_add(engine: Any) -> tuple[PromptReservation, ExpectedCommand]:
            # The add is expected from the engine thread itself, so that the step boundary right
            # after this command already waits for it (while the pull runs).
            reservation = engine.reserve_prompt(engine_request_id, prompt_ids, salt=salt, params=params)
            return reservation, self._loop.expect_command()

        def try_reserve() -> tuple[PromptReservation, ExpectedCommand] | None:
            try:
                return self._loop.call(reserve_and_expect_add, timeout_s=self._timeouts.engine_s)
            except PoolTooSmallError as error:  # waiting cannot help
                raise ServiceError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, f"generation worker: {error}"
                ) from None
            except OutOfBlocksError:
                return None

        next_heartbeat = time.monotonic() + self._timeouts.heartbeat_interval_s

        def keep_hold_alive() -> None:
            # The context worker pins the prompt until we pull it; its lease must outlast our wait.
            nonlocal next_heartbeat
            if time.monotonic() < next_heartbeat:
                return
            next_heartbeat = time.monotonic() + self._timeouts.heartbeat_interval_s
            if not self._context_client.heartbeat(
                handoff.context_address, handoff.transfer_id, self._timeouts.lease_extend_s
            ):
                raise ServiceError(grpc.StatusCode.ABORTED, "context worker dropped the prompt's pages")

        try:
            return self.admission.admit(try_reserve, stop_reason, keep_hold_alive)
        except AdmissionRefusedError as error:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"generation worker: {error}") from None

    def _check_handoff(self, handoff: worker_pb2.Handoff, prompt_ids: list[int]) -> None:
        layout = handoff.layout
        ours = self._layout
        if (layout.tokens_per_block, layout.page_bytes, layout.dtype) != (
            ours.tokens_per_block,
            ours.page_bytes,
            ours.dtype,
        ):
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"handoff.layout: page layout mismatch: context has block {layout.tokens_per_block}, "
                f"{layout.page_bytes} B/page, {layout.dtype}; this worker has block {ours.tokens_per_block}, "
                f"{ours.page_bytes} B/page, {ours.dtype}",
            )
        expected_pages = -(-len(prompt_ids) // ours.tokens_per_block)
        if ours.region_pages is not None:
            expected_pages = ours.region_pages.num_prompt_pages(len(prompt_ids))
        if handoff.prompt_len != len(prompt_ids) or len(handoff.page_ids) != expected_pages:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"handoff.prompt_len/page_ids: {handoff.prompt_len} tokens in {len(handoff.page_ids)} pages "
                f"do not describe a prompt of {len(prompt_ids)} tokens ({expected_pages} pages)",
            )

    def _pull(
        self,
        handoff: worker_pb2.Handoff,
        reservation: PromptReservation,
        stop_reason: Callable[[], ServiceError | None],
    ) -> PullResult:
        # Region pages (engine/region_pages.py): both sides list a prompt's held blocks in one
        # order, so the reservation says which of the holder's pages it still needs.
        if len(handoff.page_ids) != reservation.num_source_pages:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"handoff.page_ids: {len(handoff.page_ids)} pages, this worker expects "
                f"{reservation.num_source_pages} for a prompt of {handoff.prompt_len} tokens",
            )
        dst_page_ids = list(reservation.region_page_ids)
        src_page_ids = [int(handoff.page_ids[position]) for position in reservation.source_positions]
        if not dst_page_ids:
            return PullResult(0, 0, 0.0)
        self._wait_before_pull(stop_reason)
        started = time.perf_counter()
        handle = self._agent.pull(
            handoff.ucx_address,
            handoff.transfer_id,
            handoff.secret,
            handoff.layout.region,
            src_page_ids,
            self._layout.region_name,
            dst_page_ids,
            timeout_s=self._timeouts.pull_s,
        )
        self._metrics.change_transfers_in_flight(1)
        try:
            return self._wait_for_pull(handle, handoff, dst_page_ids, started, stop_reason)
        finally:
            self._metrics.change_transfers_in_flight(-1)

    def _wait_before_pull(self, stop_reason: Callable[[], ServiceError | None]) -> None:
        # The test hook's pause (0 in a deployment); a cancel or shutdown still ends it at once.
        deadline = time.monotonic() + self._pull_delay_s
        while time.monotonic() < deadline:
            reason = stop_reason()
            if reason is not None:
                raise reason
            time.sleep(min(POLL_INTERVAL_S, max(0.0, deadline - time.monotonic())))

    def _wait_for_pull(
        self,
        handle: PullHandle,
        handoff: worker_pb2.Handoff,
        dst_page_ids: list[int],
        started: float,
        stop_reason: Callable[[], ServiceError | None],
    ) -> PullResult:
        deadline = time.monotonic() + self._timeouts.pull_s
        next_heartbeat = time.monotonic() + self._timeouts.heartbeat_interval_s
        while True:
            status = handle.wait(POLL_INTERVAL_S)
            if status.is_final:
                break
            reason = stop_reason()
            failure = "cancelled"
            if reason is None and time.monotonic() > deadline:
                failure = "timed_out"
                reason = ServiceError(grpc.StatusCode.ABORTED, "generation worker: pull timed out")
            if reason is None and time.monotonic() > next_heartbeat:
                next_heartbeat = time.monotonic() + self._timeouts.heartbeat_interval_s
                if not self._context_client.heartbeat(
                    handoff.context_address, handoff.transfer_id, self._timeouts.lease_extend_s
                ):
                    failure = "dropped"
                    reason = ServiceError(
                        grpc.StatusCode.ABORTED, "context worker dropped the prompt's pages"
                    )
            if reason is not None:
                handle.cancel()
                self._metrics.record_transfer_failure(failure)
                raise reason
        if status is not TransferStatus.DONE:
            self._metrics.record_transfer_failure(status.name.lower())
            # ABORTED, not UNAVAILABLE: this worker is fine, the handoff is not; the coordinator
            # retries with a new prefill rather than routing around us.
            raise ServiceError(
                grpc.StatusCode.ABORTED,
                f"pull of {len(dst_page_ids)} pages from context worker {handoff.ucx_address} failed: "
                f"{status.name}: {handle.error}",
            )
        transfer_s = time.perf_counter() - started
        self._metrics.record_transfer(len(dst_page_ids), int(handle.bytes_moved), transfer_s)
        logger.info(
            "pulled %d pages (%d bytes) in %.1f ms from %s",
            len(dst_page_ids), handle.bytes_moved, transfer_s * 1000.0, handoff.ucx_address,
        )  # fmt: skip
        return PullResult(len(dst_page_ids), int(handle.bytes_moved), transfer_s * 1000.0)
