"""The aggregated server's backend: the client API of the coordinator, served by one engine that
prefills and decodes in the same process. It is the reference every disaggregated result must
equal, so it validates exactly as the coordinator does and reports stats with the same keys.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator

import grpc

from beamsplit.server.engine_loop import EngineLoop, EngineLoopError, RequestDroppedError, follow_stream
from beamsplit.server.request_validation import ModelLimits, accept_generate_request
from beamsplit.server.server_common import SHUTDOWN_MESSAGE, ShutdownGate
from beamsplit.v1 import common_pb2, coordinator_pb2
from beamsplit.wire import (
    ServiceError,
    beams_to_proto,
    delta_to_proto,
    engine_stats_to_map,
    token_logprobs_to_proto,
)
from engine.tokenizer import Tokenizer

AGGREGATED_WORKER_NAME = "aggregated"


class AggregatedService:
    def __init__(
        self,
        loop: EngineLoop,
        tokenizer: Tokenizer,
        limits: ModelLimits,
        gate: ShutdownGate,
        engine_timeout_s: float = 120.0,
    ) -> None:
        self._loop = loop
        self._tokenizer = tokenizer
        self._limits = limits
        self._gate = gate
        self._engine_timeout_s = engine_timeout_s

    def generate(
        self,
        request: coordinator_pb2.GenerateRequest,
        time_remaining: Callable[[], float | None],
        on_client_gone: Callable[[Callable[[], None]], None],
    ) -> Generator[common_pb2.GenerateResponse, None, None]:
        arrived = time.perf_counter()
        validated, request_id, engine_request_id = accept_generate_request(
            request, self._limits, self._tokenizer
        )
        client_gone = threading.Event()
        on_client_gone(client_gone.set)

        def stop_reason() -> ServiceError | None:
            if self._gate.is_aborting:
                return ServiceError(grpc.StatusCode.UNAVAILABLE, f"aggregated server: {SHUTDOWN_MESSAGE}")
            if client_gone.is_set():
                return ServiceError(grpc.StatusCode.CANCELLED, "request cancelled by the client")
            return None

        stream = self._loop.open_stream(engine_request_id)
        is_finished = False
        first_token_at: float | None = None
        try:
            self._loop.call(
                lambda engine: engine.add_request(
                    engine_request_id, validated.prompt_ids, validated.params, salt=validated.salt
                ),
                timeout_s=self._engine_timeout_s,
            )
            for output in follow_stream(stream, stop_reason, self._engine_timeout_s):
                if any(output.new_token_ids):
                    first_token_at = first_token_at or time.perf_counter()
                    delta = delta_to_proto(output, self._tokenizer)
                    yield common_pb2.GenerateResponse(request_id=request_id, delta=delta)
                if output.finished:
                    is_finished = True
                    reused_tokens = int(output.stats.get("reused_tokens", 0))
                    stats = common_pb2.RequestStats(
                        prompt_tokens=len(validated.prompt_ids),
                        context_reused_tokens=reused_tokens,
                        generation_reused_tokens=reused_tokens,
                        ttft_ms=((first_token_at or time.perf_counter()) - arrived) * 1000.0,
                        e2e_ms=(time.perf_counter() - arrived) * 1000.0,
                        context_worker=AGGREGATED_WORKER_NAME,
                        generation_worker=AGGREGATED_WORKER_NAME,
                        engine=engine_stats_to_map(output.stats),
                    )
                    final = common_pb2.FinalResult(
                        beams=beams_to_proto(output.beams, self._tokenizer),
                        stats=stats,
                        prompt_logprobs=token_logprobs_to_proto(
                            [record for record in output.prompt_logprobs or [] if record is not None]
                        ),
                    )
                    yield common_pb2.GenerateResponse(request_id=request_id, final=final)
        except ValueError as error:  # the engine refused the parameters for its configuration
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"aggregated server: {error}") from error
        except RequestDroppedError as error:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"aggregated server: {error}") from error
        except EngineLoopError as error:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"aggregated server: {error}") from error
        finally:
            if not is_finished:  # abort is a no-op for an id the engine never took
                self._loop.submit(lambda engine: engine.abort(engine_request_id))
            self._loop.close_stream(engine_request_id)
