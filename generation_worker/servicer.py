"""gRPC edge of the generation worker: messages in, `GenerationService` calls, messages out."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc

from beamsplit.server.engine_loop import EngineLoopError, RequestDroppedError
from beamsplit.server.log_context import request_context
from beamsplit.server.metrics import RequestTimer, ServerMetrics
from beamsplit.server.request_validation import (
    ModelLimits,
    RequestValidationError,
    sampling_params_from_proto,
)
from beamsplit.server.server_common import SHUTDOWN_MESSAGE, ShutdownGate
from beamsplit.server.status import worker_load
from beamsplit.server.worker_validation import check_handoff, check_id, check_token_ids
from beamsplit.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from beamsplit.wire import ServiceError, beams_to_proto, delta_to_proto, engine_stats_to_map
from engine.tokenizer import Tokenizer
from generation_worker.service import GenerationService

logger = logging.getLogger(__name__)


class GenerationWorkerServicer(worker_pb2_grpc.GenerationWorkerServicer):
    def __init__(
        self,
        service: GenerationService,
        gate: ShutdownGate,
        tokenizer: Tokenizer,
        limits: ModelLimits,
        info: common_pb2.WorkerInfo,
        metrics: ServerMetrics,
    ) -> None:
        self._service = service
        self._gate = gate
        self._tokenizer = tokenizer
        self._limits = limits
        self._info = info
        self._metrics = metrics

    def Generate(
        self, request: worker_pb2.GenerationRequest, context: grpc.ServicerContext
    ) -> Iterator[common_pb2.GenerateResponse]:
        if not self._gate.enter():
            context.abort(grpc.StatusCode.UNAVAILABLE, f"generation worker: {SHUTDOWN_MESSAGE}")
        with request_context(request.handoff.request_id):
            yield from self._generate(request, context)

    def _generate(
        self, request: worker_pb2.GenerationRequest, context: grpc.ServicerContext
    ) -> Iterator[common_pb2.GenerateResponse]:
        request_id = request.handoff.request_id
        outcome = "error"
        timer = RequestTimer(self._metrics)
        self._metrics.requests_in_flight.inc()
        try:
            check_handoff(request.handoff, self._limits.vocab_size)
            check_token_ids(request.prompt_token_ids, self._limits.vocab_size, "prompt_token_ids")
            params = sampling_params_from_proto(request.sampling, self._limits)
            if len(request.prompt_token_ids) + params.max_new_tokens > self._limits.max_model_len:
                raise RequestValidationError(
                    f"prompt_token_ids: {len(request.prompt_token_ids)} tokens + sampling.max_new_tokens "
                    f"{params.max_new_tokens} exceed the model's {self._limits.max_model_len} positions"
                )
            outputs = self._service.generate(
                request.handoff,
                list(request.prompt_token_ids),
                params,
                bytes(request.salt),
                is_client_gone=lambda: not context.is_active(),
            )
            try:
                for output in outputs:
                    if any(output.new_token_ids):
                        timer.on_delta()
                        delta = delta_to_proto(output, self._tokenizer)
                        yield common_pb2.GenerateResponse(request_id=request_id, delta=delta)
                    if output.finished:
                        final = common_pb2.FinalResult(
                            beams=beams_to_proto(output.beams, self._tokenizer),
                            stats=_stats_to_proto(output.stats),
                        )
                        outcome = "ok"
                        timer.on_final()
                        logger.info(
                            "finished: %d beams, generation_reused_tokens=%d transferred_blocks=%d",
                            len(final.beams),
                            final.stats.generation_reused_tokens,
                            final.stats.transferred_blocks,
                        )
                        yield common_pb2.GenerateResponse(request_id=request_id, final=final)
            finally:
                outputs.close()  # runs the service's cleanup now, not whenever the generator is collected
        except RequestValidationError as error:
            outcome = "invalid_argument"
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except ServiceError as error:
            outcome = error.code.name.lower()
            logger.info("failed: %s %s", error.code.name, error.message)
            context.abort(error.code, error.message)
        except RequestDroppedError as error:
            outcome = "resource_exhausted"
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"generation worker: {error}")
        except EngineLoopError as error:
            outcome = "unavailable"
            context.abort(grpc.StatusCode.UNAVAILABLE, f"generation worker: {error}")
        except GeneratorExit:  # the caller went away mid-stream (a cancel): gRPC closed this generator
            if outcome != "ok":
                outcome = "cancelled"
            raise
        except Exception as error:
            if "OutOfBlocks" in type(error).__name__:  # the pool cannot take it: expected, no trace
                code = grpc.StatusCode.RESOURCE_EXHAUSTED
                logger.info("refused: %s", error)
            else:
                code = grpc.StatusCode.INTERNAL
                logger.exception("generation of %s failed", request_id)
            outcome = code.name.lower()
            context.abort(code, f"generation worker: {type(error).__name__}: {error}")
        finally:
            self._metrics.count_request(outcome)
            self._metrics.requests_in_flight.dec()
            self._gate.exit()

    def Cancel(
        self, request: worker_pb2.CancelRequest, context: grpc.ServicerContext
    ) -> worker_pb2.CancelResponse:
        try:
            check_id(request.request_id, "request_id")
        except RequestValidationError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return worker_pb2.CancelResponse(cancelled=self._service.cancel(request.request_id))

    def GetLoad(
        self, request: common_pb2.LoadRequest, context: grpc.ServicerContext
    ) -> common_pb2.WorkerLoad:
        return worker_load(self._metrics, num_requests=self._gate.num_in_flight)

    def GetInfo(
        self, request: common_pb2.WorkerInfoRequest, context: grpc.ServicerContext
    ) -> common_pb2.WorkerInfo:
        return self._info


def _stats_to_proto(stats: dict[str, float | int]) -> common_pb2.RequestStats:
    return common_pb2.RequestStats(
        prompt_tokens=int(stats.get("prompt_tokens", 0)),
        generation_reused_tokens=int(stats.get("generation_reused_tokens", 0)),
        transferred_blocks=int(stats.get("transferred_blocks", 0)),
        transferred_bytes=int(stats.get("transferred_bytes", 0)),
        transfer_ms=float(stats.get("transfer_ms", 0.0)),
        engine=engine_stats_to_map(stats),
    )
