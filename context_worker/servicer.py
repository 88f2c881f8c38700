"""gRPC edge of the context worker: messages in, `ContextService` calls, messages out."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NoReturn

import grpc

from beamsplit.server.admission_queue import AdmissionRefusedError
from beamsplit.server.engine_loop import EngineLoopError
from beamsplit.server.log_context import request_context
from beamsplit.server.metrics import ServerMetrics
from beamsplit.server.request_validation import RequestValidationError
from beamsplit.server.server_common import SHUTDOWN_MESSAGE, ShutdownGate
from beamsplit.server.status import worker_load
from beamsplit.server.worker_validation import check_id, check_num_candidates, check_token_ids
from beamsplit.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from beamsplit.wire import ServiceError, token_logprobs_to_proto
from context_worker.service import ContextService
from engine.block_allocator import OutOfBlocksError
from engine.config import MAX_LOGPROBS

logger = logging.getLogger(__name__)


class ContextWorkerServicer(worker_pb2_grpc.ContextWorkerServicer):
    def __init__(
        self,
        service: ContextService,
        gate: ShutdownGate,
        layout: worker_pb2.PageLayout,
        info: common_pb2.WorkerInfo,
        metrics: ServerMetrics,
    ) -> None:
        self._service = service
        self._gate = gate
        self._layout = layout
        self._info = info
        self._metrics = metrics

    def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        with request_context(request.request_id):
            return self._prefill(request, context)

    def _prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        """Every call is counted once in beamsplit_requests_total: ok when the handoff goes out,
        else the status it ended with (a refusal included)."""
        outcome = "error"

        def abort(code: grpc.StatusCode, message: str) -> NoReturn:
            nonlocal outcome
            outcome = code.name.lower()
            context.abort(code, message)
            raise AssertionError("abort raises")

        self._metrics.requests_in_flight.inc()
        try:
            response = self._prefill_or_abort(request, context, abort)
            outcome = "ok"
            return response
        finally:
            self._metrics.count_request(outcome)
            self._metrics.requests_in_flight.dec()

    def _prefill_or_abort(
        self,
        request: worker_pb2.PrefillRequest,
        context: grpc.ServicerContext,
        abort: Callable[[grpc.StatusCode, str], NoReturn],
    ) -> worker_pb2.PrefillResponse:
        if not self._gate.enter():
            abort(grpc.StatusCode.UNAVAILABLE, SHUTDOWN_MESSAGE)
        try:
            self._check_prefill(request)
            held = self._service.prefill(
                request_id=request.request_id,
                attempt=request.attempt,
                prompt_ids=list(request.prompt_token_ids),
                num_candidates=request.num_candidates,
                salt=bytes(request.salt),
                lease_s=request.lease_s,
                is_caller_gone=lambda: not context.is_active() or self._gate.is_aborting,
                prompt_logprobs=request.prompt_logprobs if request.HasField("prompt_logprobs") else None,
            )
        except ValueError as error:
            abort(grpc.StatusCode.INVALID_ARGUMENT, f"context worker: {error}")
        except EngineLoopError as error:
            abort(grpc.StatusCode.UNAVAILABLE, f"context worker: {error}")
        except MemoryError as error:
            abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"context worker: {error}")
        except (AdmissionRefusedError, OutOfBlocksError) as error:  # a full queue or a pool too small
            logger.info("refused: %s", error)
            abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"context worker: {error}")
        except ServiceError as error:
            abort(error.code, error.message)
        except Exception as error:
            logger.exception("prefill %s failed", request.request_id)
            code = _status_for(error)
            abort(code, f"context worker: prefill failed: {type(error).__name__}: {error}")
        finally:
            self._gate.exit()
        if not context.is_active():
            # The caller gave up (deadline, cancel) while we prefilled: nobody will pull or release.
            self._service.release(held.transfer_id, "caller gone before the handoff")
            abort(grpc.StatusCode.CANCELLED, "context worker: caller gone before the handoff")
        handoff = worker_pb2.Handoff(
            request_id=held.request_id,
            attempt=held.attempt,
            transfer_id=held.transfer_id,
            ucx_address=held.ucx_address,
            layout=self._layout,
            page_ids=held.page_ids,
            prompt_len=held.prompt_len,
            candidate_ids=held.candidate_ids,
            candidate_logprobs=held.candidate_logprobs,
            candidate_model_logprobs=held.candidate_model_logprobs,
            secret=held.secret,
            lease_deadline_unix_ms=held.lease_deadline_unix_ms,
            reused_tokens=held.reused_tokens,
            recurrent_state=held.recurrent_state,
            num_tokens_before_hybrid_pruning=held.num_tokens_before_hybrid_pruning,
        )
        return worker_pb2.PrefillResponse(
            handoff=handoff,
            prefill_ms=held.prefill_ms,
            prompt_logprobs=token_logprobs_to_proto(held.prompt_logprobs or []),
        )

    def _check_prefill(self, request: worker_pb2.PrefillRequest) -> None:
        check_id(request.request_id, "request_id")
        check_token_ids(request.prompt_token_ids, self._info.vocab_size, "prompt_token_ids")
        if len(request.prompt_token_ids) >= self._info.max_model_len:
            raise RequestValidationError(
                f"prompt_token_ids: {len(request.prompt_token_ids)} tokens leave no room in the model's "
                f"{self._info.max_model_len} positions"
            )
        check_num_candidates(request.num_candidates, self._info.vocab_size)
        if request.HasField("prompt_logprobs") and not 0 <= request.prompt_logprobs <= MAX_LOGPROBS:
            raise RequestValidationError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {request.prompt_logprobs}"
            )

    def Release(
        self, request: worker_pb2.ReleaseRequest, context: grpc.ServicerContext
    ) -> worker_pb2.ReleaseResponse:
        _check_transfer_id(request.transfer_id, context)
        released = self._service.release(request.transfer_id, request.reason or "released by peer")
        return worker_pb2.ReleaseResponse(released=released)

    def Heartbeat(
        self, request: worker_pb2.HeartbeatRequest, context: grpc.ServicerContext
    ) -> worker_pb2.HeartbeatResponse:
        _check_transfer_id(request.transfer_id, context)
        alive, deadline_ms = self._service.heartbeat(request.transfer_id, request.extend_s)
        return worker_pb2.HeartbeatResponse(alive=alive, lease_deadline_unix_ms=deadline_ms)

    def GetLoad(
        self, request: common_pb2.LoadRequest, context: grpc.ServicerContext
    ) -> common_pb2.WorkerLoad:
        return worker_load(self._metrics, num_requests=self._gate.num_in_flight + self._service.num_holds)

    def GetInfo(
        self, request: common_pb2.WorkerInfoRequest, context: grpc.ServicerContext
    ) -> common_pb2.WorkerInfo:
        return self._info


def _check_transfer_id(transfer_id: str, context: grpc.ServicerContext) -> None:
    try:
        check_id(transfer_id, "transfer_id")
    except RequestValidationError as error:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"context worker: {error}")


def _status_for(error: Exception) -> grpc.StatusCode:
    # The engine signals a full pool with its own error type; match by name to stay decoupled.
    if "OutOfBlocks" in type(error).__name__:
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return grpc.StatusCode.INTERNAL
