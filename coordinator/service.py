"""The coordinator's logic, free of the servicer: validate, route, hand off, stream.

One client request: validate and tokenize (INVALID_ARGUMENT naming the field), pick a healthy
context worker and prefill there, pick a healthy generation worker and stream its deltas through,
then add the request's stats to the final message. Both picks prefer the worker whose prefix tree
probably holds most of the prompt, within a load slack, then the least loaded
(coordinator/prefix_routing.py); a worker's index learns a prompt once the worker took it (the
context worker answered its Prefill, the generation worker streamed). A worker that
is unreachable before anything reached the client is marked unhealthy and the request tries
again elsewhere (a new attempt number, so a new transfer id); after that, failures reach the
client as UNAVAILABLE with the worker's address and reason. Whatever happens, the context
worker's hold is released (Release is idempotent).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import grpc

from beamsplit.server.request_validation import (
    ModelLimits,
    ValidatedRequest,
    accept_generate_request,
    sampling_params_to_proto,
)
from beamsplit.v1 import common_pb2, coordinator_pb2, worker_pb2
from beamsplit.wire import ServiceError
from coordinator.prefix_routing import PromptKeys, prompt_keys
from coordinator.worker_pool import WorkerHandle, WorkerPool
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoordinatorSettings:
    max_attempts: int = 2
    prefill_timeout_s: float = 120.0
    request_timeout_s: float = 600.0  # when the client sets no deadline
    lease_s: float = 30.0
    release_timeout_s: float = 2.0
    tokens_per_block: int = 32  # the fleet's: prompt keys for prefix-aware routing


class _Attempt:
    """One try's upstream state, so a client cancel can stop it from the servicer's callback."""

    def __init__(self) -> None:
        self.generation_call: Any = None  # the streaming call, which can be cancelled
        self.is_cancelled = False

    def cancel(self) -> None:
        self.is_cancelled = True
        if self.generation_call is not None:
            self.generation_call.cancel()


class CoordinatorService:
    def __init__(
        self,
        context_pool: WorkerPool,
        generation_pool: WorkerPool,
        tokenizer: Tokenizer,
        limits: ModelLimits,
        settings: CoordinatorSettings,
    ) -> None:
        self._context_pool = context_pool
        self._generation_pool = generation_pool
        self._tokenizer = tokenizer
        self._limits = limits
        self._settings = settings

    def generate(
        self,
        request: coordinator_pb2.GenerateRequest,
        time_remaining: Callable[[], float | None],
        on_client_gone: Callable[[Callable[[], None]], None],
    ) -> Generator[common_pb2.GenerateResponse, None, None]:
        arrived = time.perf_counter()
        validated, request_id, routed_id = accept_generate_request(request, self._limits, self._tokenizer)
        attempt_state = _Attempt()
        on_client_gone(attempt_state.cancel)
        full_workers: dict[str, str] = {}  # generation workers whose pool refused this request
        keys = prompt_keys(validated.prompt_ids, validated.salt, self._settings.tokens_per_block)
        for attempt in range(self._settings.max_attempts):
            is_last = attempt == self._settings.max_attempts - 1
            responses = self._try_once(
                routed_id, attempt, validated, keys, time_remaining, attempt_state, is_last, full_workers
            )
            first_token_at: float | None = None
            try:
                for response in responses:
                    if response.HasField("delta") and first_token_at is None:
                        first_token_at = time.perf_counter()
                    if response.HasField("final"):
                        stats = response.final.stats
                        stats.prompt_tokens = len(validated.prompt_ids)
                        stats.ttft_ms = ((first_token_at or time.perf_counter()) - arrived) * 1000.0
                        stats.e2e_ms = (time.perf_counter() - arrived) * 1000.0
                    response.request_id = request_id
                    yield response
                return
            except _PoolFullError as error:
                full_workers[error.address] = error.details
                logger.warning("request %s attempt %d: %s, retrying elsewhere", request_id, attempt, error)
            except _RetryableError as error:
                logger.warning("request %s attempt %d failed, retrying: %s", request_id, attempt, error)
            finally:
                responses.close()  # a client that left: release and cancel upstream now
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no attempt succeeded")

    def _try_once(
        self,
        routed_id: str,
        attempt: int,
        validated: ValidatedRequest,
        keys: PromptKeys,
        time_remaining: Callable[[], float | None],
        attempt_state: _Attempt,
        is_last: bool,
        full_workers: dict[str, str],
    ) -> Generator[common_pb2.GenerateResponse, None, None]:
        # Both workers are chosen before any work starts: no prefill for a request nobody can decode.
        context_worker = self._context_pool.pick(keys=keys)
        if context_worker is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no healthy context worker")
        generation_worker = self._generation_pool.pick(exclude=set(full_workers), keys=keys)
        if generation_worker is None:
            self._context_pool.finish(context_worker)
            if full_workers:
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, _pool_full_message(full_workers))
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no healthy generation worker")
        handoff: worker_pb2.Handoff | None = None
        is_streaming = False
        try:
            prompt_ids = validated.prompt_ids
            sampling = sampling_params_to_proto(validated.params)
            num_candidates = _num_candidates(sampling, self._limits.vocab_size)
            prefill_request = worker_pb2.PrefillRequest(
                request_id=routed_id,
                attempt=attempt,
                prompt_token_ids=prompt_ids,
                num_candidates=num_candidates,
                salt=validated.salt,
                lease_s=self._settings.lease_s,
            )
            if sampling.HasField("prompt_logprobs"):
                prefill_request.prompt_logprobs = sampling.prompt_logprobs
            try:
                prefill = context_worker.stub.Prefill(
                    prefill_request,
                    timeout=self._timeout(time_remaining, self._settings.prefill_timeout_s),
                )
            except grpc.RpcError as error:
                raise self._upstream_error(
                    self._context_pool, context_worker, error, is_last, streamed=False
                ) from None
            handoff = prefill.handoff
            handoff.context_address = context_worker.address
            self._context_pool.remember(context_worker, keys)
            if attempt_state.is_cancelled:
                raise ServiceError(grpc.StatusCode.CANCELLED, "request cancelled by the client")
            call = generation_worker.stub.Generate(
                worker_pb2.GenerationRequest(
                    handoff=handoff, prompt_token_ids=prompt_ids, sampling=sampling, salt=validated.salt
                ),
                timeout=self._timeout(time_remaining, self._settings.request_timeout_s),
            )
            attempt_state.generation_call = call
            try:
                for response in call:
                    if not is_streaming:  # it reserved, pulled and committed the prompt
                        self._generation_pool.remember(generation_worker, keys)
                    is_streaming = True
                    if response.HasField("final"):
                        stats = response.final.stats
                        stats.context_reused_tokens = handoff.reused_tokens
                        # What the context side's pages alone held (hybrid snapshots may cut it).
                        stats.engine["context_num_tokens_before_hybrid_pruning"] = float(
                            handoff.num_tokens_before_hybrid_pruning
                        )
                        stats.context_worker = context_worker.address
                        stats.generation_worker = generation_worker.address
                        # Scored on the context side, during its prefill (docs/http.md).
                        response.final.prompt_logprobs.extend(prefill.prompt_logprobs)
                    yield response
                    if response.HasField("final"):
                        return
            except grpc.RpcError as error:
                if attempt_state.is_cancelled:
                    raise ServiceError(grpc.StatusCode.CANCELLED, "request cancelled by the client") from None
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not is_streaming:
                    # Nothing reached the client: another generation worker may have room.
                    details = error.details() or "pool full"
                    if is_last:
                        full_workers[generation_worker.address] = details
                        raise ServiceError(
                            grpc.StatusCode.RESOURCE_EXHAUSTED, _pool_full_message(full_workers)
                        ) from None
                    raise _PoolFullError(generation_worker.address, details) from None
                raise self._upstream_error(
                    self._generation_pool, generation_worker, error, is_last, streamed=is_streaming
                ) from None
            raise ServiceError(
                grpc.StatusCode.INTERNAL,
                f"generation worker {generation_worker.address} ended without a result",
            )
        finally:
            if attempt_state.generation_call is not None:
                attempt_state.generation_call.cancel()  # no-op once it ended; stops it otherwise
                attempt_state.generation_call = None
            if handoff is not None:
                self._release(context_worker, handoff.transfer_id)
            self._context_pool.finish(context_worker)
            self._generation_pool.finish(generation_worker)

    def _upstream_error(
        self, pool: WorkerPool, worker: WorkerHandle, error: grpc.RpcError, is_last: bool, streamed: bool
    ) -> Exception:
        """What a worker's failure becomes: a retry (nothing streamed yet) or the client's status.

        UNAVAILABLE means the worker itself is gone or going: it leaves routing until a probe
        finds it serving. ABORTED means the handoff failed (the pull, or the context worker's hold)
        while the worker is fine: a new attempt prefills again, on whichever workers are best.
        """
        code = error.code()
        details = error.details() or code.name
        if code == grpc.StatusCode.UNAVAILABLE:
            pool.mark_unhealthy(worker, details)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED):
            if not is_last and not streamed:
                return _RetryableError(f"{pool.kind} worker {worker.address}: {details}")
            return ServiceError(
                grpc.StatusCode.UNAVAILABLE, f"{pool.kind} worker {worker.address} failed: {details}"
            )
        if code in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.CANCELLED,
        ):
            return ServiceError(code, f"{pool.kind} worker {worker.address}: {details}")
        return ServiceError(code, f"{pool.kind} worker {worker.address} failed: {details}")

    def _release(self, worker: WorkerHandle, transfer_id: str) -> None:
        try:
            worker.stub.Release(
                worker_pb2.ReleaseRequest(transfer_id=transfer_id, reason="request ended"),
                timeout=self._settings.release_timeout_s,
            )
        except grpc.RpcError as error:
            logger.info(
                "release %s on %s failed (its lease will lapse): %s",
                transfer_id,
                worker.address,
                error.code(),
            )

    def _timeout(self, time_remaining: Callable[[], float | None], default_s: float) -> float:
        remaining = time_remaining()
        if remaining is None:
            return default_s
        return max(0.001, min(default_s, remaining))


class _RetryableError(Exception):
    """An attempt failed before anything reached the client; another worker may serve it."""


class _PoolFullError(Exception):
    """A generation worker's pool refused the request before anything was streamed."""

    def __init__(self, address: str, details: str) -> None:
        super().__init__(f"generation worker {address}: {details}")
        self.address = address
        self.details = details


def _pool_full_message(full_workers: dict[str, str]) -> str:
    refusals = "; ".join(f"{address}: {details}" for address, details in full_workers.items())
    return f"no generation worker has room for this request ({refusals})"


def _num_candidates(sampling: common_pb2.SamplingOptions, vocab_size: int) -> int:
    # Beam search needs the top 2W, greedy the top 1, sampling its top-k (0: the whole vocabulary);
    # with logprobs k, at least the first token's k alternatives (more candidates choose the same).
    if sampling.beam_width > 1:
        needed = 2 * sampling.beam_width
    elif sampling.temperature == 0:
        needed = 1
    else:
        needed = sampling.top_k if sampling.top_k > 0 else vocab_size
    if sampling.HasField("logprobs"):
        needed = min(vocab_size, max(needed, sampling.logprobs))
    return needed
