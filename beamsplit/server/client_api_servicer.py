"""The client-facing `Coordinator` servicer, shared by the coordinator and the aggregated server.

It only converts: the backend (`CoordinatorService` or `AggregatedService`) yields responses or
raises `ServiceError`, and this class turns that into a stream or a status. A client that cancels
or whose deadline passes triggers the backend's callback so upstream work stops at once.
`instrumented_responses` is the one request loop both fronts (this servicer and the HTTP front's
`BackendCall`) run: the shutdown check, the request id in the logs, latencies and outcome counts.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Generator, Iterator
from typing import Protocol

import grpc

from beamsplit.server.log_context import request_context
from beamsplit.server.metrics import RequestTimer, ServerMetrics
from beamsplit.server.server_common import SHUTDOWN_MESSAGE, ShutdownGate
from beamsplit.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from beamsplit.wire import ServiceError

logger = logging.getLogger(__name__)


class GenerateBackend(Protocol):
    def generate(
        self,
        request: coordinator_pb2.GenerateRequest,
        time_remaining: Callable[[], float | None],
        on_client_gone: Callable[[Callable[[], None]], None],
    ) -> Generator[common_pb2.GenerateResponse, None, None]: ...


class ClientApiServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(
        self,
        backend: GenerateBackend,
        gate: ShutdownGate,
        metrics: ServerMetrics,
        role: str,
        status: Callable[[], coordinator_pb2.StatusResponse] | None = None,
    ) -> None:
        self._backend = backend
        self._gate = gate
        self._metrics = metrics
        self._role = role
        self._status = status

    def GetStatus(
        self, request: coordinator_pb2.StatusRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.StatusResponse:
        status = self._status
        if status is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{self._role}: no status")
            raise AssertionError("abort raises")
        return status()

    def Generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[common_pb2.GenerateResponse]:
        if not self._gate.enter():
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self._role}: {SHUTDOWN_MESSAGE}")
        if not request.request_id:  # named here so that every log line of the request carries it
            request.request_id = uuid.uuid4().hex
        with request_context(request.request_id):
            yield from self._generate(request, context)

    def _generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[common_pb2.GenerateResponse]:
        def on_client_gone(callback: Callable[[], None]) -> None:
            context.add_callback(callback)

        try:
            yield from instrumented_responses(
                self._backend,
                request,
                context.time_remaining,
                on_client_gone,
                self._gate,
                self._metrics,
                self._role,
            )
        except ServiceError as error:
            context.abort(error.code, error.message)


def instrumented_responses(
    backend: GenerateBackend,
    request: coordinator_pb2.GenerateRequest,
    time_remaining: Callable[[], float | None],
    on_client_gone: Callable[[Callable[[], None]], None],
    gate: ShutdownGate,
    metrics: ServerMetrics,
    role: str,
    is_cancelled: Callable[[], bool] = lambda: False,
) -> Generator[common_pb2.GenerateResponse, None, None]:
    """The backend's responses to one request that has entered `gate` (this exits it).

    Raises `ServiceError` for every failure (anything unexpected becomes INTERNAL, logged);
    `is_cancelled` is a front's own view of its client leaving (CANCELLED).
    """
    outcome = "error"
    timer = RequestTimer(metrics)
    metrics.requests_in_flight.inc()
    try:
        responses = backend.generate(request, time_remaining, on_client_gone)
        try:
            for response in responses:
                if gate.is_aborting:
                    raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"{role}: {SHUTDOWN_MESSAGE}")
                if is_cancelled():
                    raise ServiceError(grpc.StatusCode.CANCELLED, "request cancelled by the client")
                if response.HasField("delta"):
                    timer.on_delta()
                if response.HasField("final"):
                    outcome = "ok"
                    timer.on_final()
                    logger.info("finished: %s", _describe_stats(response.final.stats))
                yield response
        finally:
            responses.close()  # runs the backend's cleanup now, not at garbage collection
    except ServiceError as error:
        if outcome != "ok":
            outcome = error.code.name.lower()
        logger.info("failed: %s %s", error.code.name, error.message)
        raise
    except GeneratorExit:  # the client went away between two responses: gRPC closed this generator
        if outcome != "ok":
            outcome = "cancelled"
        raise
    except Exception as error:
        logger.exception("request failed")
        raise ServiceError(grpc.StatusCode.INTERNAL, f"{role}: {type(error).__name__}: {error}") from error
    finally:
        metrics.count_request(outcome)
        metrics.requests_in_flight.dec()
        gate.exit()


def _describe_stats(stats: common_pb2.RequestStats) -> str:
    return (
        f"prompt_tokens={stats.prompt_tokens} context_reused_tokens={stats.context_reused_tokens} "
        f"generation_reused_tokens={stats.generation_reused_tokens} "
        f"transferred_blocks={stats.transferred_blocks} ttft_ms={stats.ttft_ms:.1f} e2e_ms={stats.e2e_ms:.1f} "
        f"context_worker={stats.context_worker} generation_worker={stats.generation_worker}"
    )
