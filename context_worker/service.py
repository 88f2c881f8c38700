"""The context worker's logic, free of gRPC: prefill once, hold the prompt's pages under a lease.

A prefill goes through the engine's batch (`LLMEngine.add_prefill`): prompts that arrive together
run in the same forward passes, and a long prompt runs in chunks under the token budget, so it
does not hold up the short ones behind it. The handler waits, bounded by the engine timeout, for
the finished output that carries the PrefillResult.

A hold starts when `prefill` returns and ends exactly once, whichever comes first:
- the transfer agent reports the offer ended (pulled: DONE, revoked, lease lapsed, failed),
- the generation side (or the coordinator) calls `release`,
- the reaper finds the lease past its deadline (a backstop that runs on its own timer, in case
  an agent never reports),
- shutdown.
Ending a hold unpins the prompt's pages (`release_prefill`); its full blocks stay in the prefix
tree, unreferenced, for the next prompt that shares them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from beamsplit.server.admission_queue import AdmissionLimits, AdmissionQueue
from beamsplit.server.engine_loop import EngineLoop, EngineLoopError, OutputStream, RequestDroppedError
from beamsplit.server.log_context import request_context
from beamsplit.server.metrics import ServerMetrics
from beamsplit.wire import PULLED_REASON, ServiceError
from engine.block_allocator import OutOfBlocksError, PoolTooSmallError
from engine.types import TokenLogprob
from transfer import TransferAgent, TransferStatus

logger = logging.getLogger(__name__)

# The reaper gives the agent this long past the deadline to report the lapse itself.
REAPER_SLACK_S = 2.0


@dataclass(frozen=True)
class HeldPrompt:
    request_id: str
    attempt: int
    transfer_id: str
    secret: str
    ucx_address: str
    page_ids: list[int]
    prompt_len: int
    candidate_ids: list[int]
    candidate_logprobs: list[float]
    candidate_model_logprobs: list[float]
    reused_tokens: int
    lease_deadline_unix_ms: int
    recurrent_state: bytes  # hybrid models: the state after the prompt; empty otherwise
    num_tokens_before_hybrid_pruning: int
    prefill_ms: float
    prompt_logprobs: list[TokenLogprob] | None = None  # positions 1 .. P-1, when asked


@dataclass
class _Hold:
    request_id: str
    engine_request_id: str
    num_pages: int
    deadline: float  # time.monotonic()


class ContextService:
    def __init__(
        self,
        loop: EngineLoop,
        agent: TransferAgent,
        region_name: str,
        metrics: ServerMetrics,
        default_lease_s: float = 30.0,
        engine_timeout_s: float = 120.0,
        page_bytes: int = 0,  # for the served-bytes counter
        prefill_delay_s: float = 0.0,  # a test hook (beamsplit/server/fault_hooks.py)
        admission: AdmissionLimits | None = None,
    ) -> None:
        self._prefill_delay_s = prefill_delay_s
        # A prompt that does not fit next to the pinned ones waits for a hold to end (bounded).
        self.admission = AdmissionQueue(
            admission or AdmissionLimits(), "KV blocks on this context worker", metrics.set_queued_requests
        )
        self._loop = loop
        self._agent = agent
        self._region_name = region_name
        self._metrics = metrics
        self._default_lease_s = default_lease_s
        self._engine_timeout_s = engine_timeout_s
        self._page_bytes = page_bytes
        self._holds: dict[str, _Hold] = {}
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._reaper = threading.Thread(target=self._reap_forever, name="lease-reaper", daemon=True)
        self._reaper.start()

    @property
    def num_holds(self) -> int:
        with self._lock:
            return len(self._holds)

    def prefill(
        self,
        request_id: str,
        attempt: int,
        prompt_ids: list[int],
        num_candidates: int,
        salt: bytes,
        lease_s: float,
        is_caller_gone: Callable[[], bool] = lambda: False,
        prompt_logprobs: int | None = None,
    ) -> HeldPrompt:
        """prompt_logprobs (k, or None): also score every prompt position (engine/logprobs.py)."""
        lease_s = lease_s if lease_s > 0 else self._default_lease_s
        engine_request_id = f"{request_id}#{attempt}"
        started = time.perf_counter()

        def add_prefill(engine: Any) -> None:
            if self._prefill_delay_s:
                time.sleep(self._prefill_delay_s)  # on the engine thread: later prefills queue
            # Allocates now: a full pool raises here (OutOfBlocksError), holding nothing.
            engine.add_prefill(
                engine_request_id, prompt_ids, num_candidates, salt=salt, prompt_logprobs=prompt_logprobs
            )

        stream = self._loop.open_stream(engine_request_id)
        try:

            def try_add() -> bool | None:
                try:
                    self._loop.call(add_prefill, timeout_s=self._engine_timeout_s)
                except PoolTooSmallError:
                    raise
                except OutOfBlocksError:
                    return None  # not now: wait in the queue for a hold to end
                return True

            def stop_reason() -> ServiceError | None:
                if is_caller_gone():
                    return ServiceError(grpc.StatusCode.CANCELLED, "context worker: caller gone while queued")
                return None

            self.admission.admit(try_add, stop_reason)
            # The engine bound starts once the prompt is in the batch (the queue has its own).
            result = self._wait_for_prefill(stream, time.monotonic() + self._engine_timeout_s)
        except (EngineLoopError, RequestDroppedError):
            # The prefill may still be queued, part-way or done after the bound: drop it and
            # unpin whatever it pinned (the abort runs after it on the engine thread).
            self._abort_prefill(engine_request_id)
            raise
        finally:
            self._loop.close_stream(engine_request_id)
        prefill_s = time.perf_counter() - started
        self._metrics.prefill_latency.observe(prefill_s)
        # The lock spans offer and record so that an on_done from the agent's timer (which takes
        # the lock) always finds the hold. The agent fires on_done outside its own locks.
        with self._lock:
            try:
                # Region pages: a window-aware pool offers, per KV group, only the window's pages.
                offer = self._agent.offer(
                    self._region_name, list(result.region_page_ids), lease_s, on_done=self._on_offer_done
                )
            except Exception:
                self._release_pages(engine_request_id)
                raise
            self._holds[offer.transfer_id] = _Hold(
                request_id, engine_request_id, len(result.region_page_ids), offer.expires_at
            )
            self._metrics.set_transfers_in_flight(len(self._holds))
        logger.info(
            "prefilled %d tokens (%d reused) in %.1f ms; %d pages held as %s for %.0f s",
            result.prompt_len, result.reused_tokens, prefill_s * 1000.0, len(result.region_page_ids),
            offer.transfer_id, lease_s,
        )  # fmt: skip
        return HeldPrompt(
            request_id=request_id,
            attempt=attempt,
            transfer_id=offer.transfer_id,
            secret=offer.secret,
            ucx_address=offer.address,
            page_ids=list(result.region_page_ids),
            prompt_len=result.prompt_len,
            candidate_ids=list(result.candidate_ids),
            candidate_logprobs=list(result.candidate_logprobs),
            candidate_model_logprobs=list(result.candidate_model_logprobs),
            reused_tokens=result.reused_tokens,
            recurrent_state=result.recurrent_state,
            num_tokens_before_hybrid_pruning=result.num_tokens_before_hybrid_pruning,
            lease_deadline_unix_ms=_monotonic_to_unix_ms(offer.expires_at),
            prefill_ms=prefill_s * 1000.0,
            prompt_logprobs=result.prompt_logprobs,
        )

    def release(self, transfer_id: str, reason: str) -> bool:
        """Ends the hold now (idempotent); False when it had already ended.

        The served pages are counted by whichever of this and `_on_offer_done` pops the hold, so
        once per transfer: the generation worker releases with reason "pulled" as soon as its pull
        completes, which often reaches us before the agent reports the offer done (that race left
        this side's beamsplit_transfer_blocks_total short of the generation worker's)."""
        hold = self._pop_hold(transfer_id)
        if hold is None:
            return False
        if reason == PULLED_REASON:
            num_pages = self._agent.num_pages_pulled(transfer_id)
            self._metrics.record_transfer(num_pages, num_pages * self._page_bytes)
        with request_context(hold.request_id):
            try:
                self._agent.revoke(transfer_id)
            except Exception:  # the offer may have ended on its own meanwhile; the pages go back anyway
                logger.debug("revoke %s failed", transfer_id, exc_info=True)
            logger.info("released %s (%s)", transfer_id, reason)
            self._release_pages(hold.engine_request_id)
        return True

    def heartbeat(self, transfer_id: str, extend_s: float) -> tuple[bool, int]:
        """Extends the lease; (alive, new deadline in unix ms)."""
        extend_s = extend_s if extend_s > 0 else self._default_lease_s
        with self._lock:
            hold = self._holds.get(transfer_id)
        if hold is None or not self._agent.extend(transfer_id, extend_s):
            return False, 0
        deadline = time.monotonic() + extend_s
        with self._lock:
            hold.deadline = deadline
        return True, _monotonic_to_unix_ms(deadline)

    def shutdown(self) -> None:
        """Ends every hold; the engine loop must still be running."""
        self._stopping.set()
        with self._lock:
            transfer_ids = list(self._holds)
        for transfer_id in transfer_ids:
            self.release(transfer_id, "server shutting down")
        self._reaper.join(timeout=2.0)

    def _on_offer_done(self, transfer_id: str, status: TransferStatus) -> None:
        # Runs on the agent's thread: never call back into the agent from here (its read-only
        # num_pages_pulled excepted: it only takes the offer book's lock, free while on_done runs).
        hold = self._pop_hold(transfer_id)
        if hold is None:  # ended through release(), which already returned the pages
            return
        if status is TransferStatus.DONE:
            # The puller takes only the pages it lacks; the book's read takes no agent thread.
            num_pages = self._agent.num_pages_pulled(transfer_id)
            self._metrics.record_transfer(num_pages, num_pages * self._page_bytes)
        elif status is TransferStatus.TIMED_OUT:
            self._metrics.record_lease_expiry()
            self._metrics.record_transfer_failure("lease_lapsed")
        elif status is TransferStatus.FAILED:
            self._metrics.record_transfer_failure("failed")
        with request_context(hold.request_id):
            logger.info("offer %s ended: %s", transfer_id, status.name)
            self._release_pages(hold.engine_request_id)

    def _pop_hold(self, transfer_id: str) -> _Hold | None:
        with self._lock:
            hold = self._holds.pop(transfer_id, None)
            self._metrics.set_transfers_in_flight(len(self._holds))
            return hold

    def _wait_for_prefill(self, stream: OutputStream, deadline: float) -> Any:
        """The PrefillResult of the finished output on `stream`, waited for until `deadline`."""
        while True:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise EngineLoopError(
                    f"engine did not finish the prefill within {self._engine_timeout_s:.1f} s"
                )
            try:
                output = stream.get(timeout_s=min(remaining_s, 1.0))
            except queue.Empty:
                continue
            if output is None:
                raise EngineLoopError("engine step failed")
            if output.error is not None:
                raise RequestDroppedError(output.error)
            if output.finished and output.prefill is not None:
                return output.prefill

    def _abort_prefill(self, engine_request_id: str) -> None:
        future = self._loop.submit(lambda engine: engine.abort(engine_request_id))
        future.add_done_callback(lambda done: _log_failure(done, f"abort {engine_request_id}"))

    def _release_pages(self, engine_request_id: str) -> None:
        future = self._loop.submit(lambda engine: engine.release_prefill(engine_request_id))
        future.add_done_callback(lambda done: _log_failure(done, f"release_prefill {engine_request_id}"))

    def _reap_forever(self) -> None:
        while not self._stopping.wait(1.0):
            now = time.monotonic()
            with self._lock:
                lapsed = [tid for tid, hold in self._holds.items() if hold.deadline + REAPER_SLACK_S < now]
            for transfer_id in lapsed:
                if self.release(transfer_id, "lease lapsed"):
                    self._metrics.record_lease_expiry()
                    self._metrics.record_transfer_failure("lease_lapsed")


def _monotonic_to_unix_ms(deadline: float) -> int:
    return int((time.time() + (deadline - time.monotonic())) * 1000.0)


def _log_failure(future: Any, what: str) -> None:
    error = future.exception()
    if error is not None:
        logger.error("%s failed: %s", what, error)
