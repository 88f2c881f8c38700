"""The aggregated server's queue is its scheduler's, bounded by `QueueLimits`: past the bound a
client gets RESOURCE_EXHAUSTED naming the limit, the queued request runs once blocks free, and the
pool returns to 0 with the engine's integrity intact. In this process: `AggregatedService` over a
real `EngineLoop` and a 16-block float32 `tiny` engine (block 16).

FILL: a 40-token prompt, W = 2, 200 new tokens: 2 + 2 * (15 - 2) = 28 > 16 blocks would never fit,
so W = 1 and 200 new tokens: 2 + (15 - 2) = 15 blocks, leaving 1: a SMALL request (3 blocks) waits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
import pytest

from beamsplit.server.aggregated import AggregatedService
from beamsplit.server.engine_loop import EngineLoop
from beamsplit.server.request_validation import ModelLimits
from beamsplit.server.server_common import ShutdownGate
from beamsplit.v1 import common_pb2, coordinator_pb2
from beamsplit.wire import ServiceError
from engine import CacheConfig, EngineConfig, LLMEngine
from engine.scheduler import QueueLimits

FILL = common_pb2.SamplingOptions(beam_width=1, max_new_tokens=200, ignore_eos=True)
SMALL = common_pb2.SamplingOptions(beam_width=1, max_new_tokens=4)
BOUND_S = 30.0


def prompt(offset: int) -> list[int]:
    return [(offset + 11 * index) % 250 for index in range(40)]


def wait_for(condition: Callable[[], bool], what: str) -> None:
    pause = threading.Event()
    for _ in range(int(BOUND_S / 0.02)):
        if condition():
            return
        pause.wait(0.02)
    raise AssertionError(f"not reached within {BOUND_S:.0f} s: {what}")


class Served:
    """One `generate` on a thread, with a handle to leave as a client would."""

    def __init__(
        self, service: AggregatedService, token_ids: list[int], sampling: common_pb2.SamplingOptions
    ):
        request = coordinator_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(token_ids=token_ids), sampling=sampling
        )
        self._callbacks: list[Callable[[], None]] = []
        self._responses = service.generate(request, lambda: None, self._callbacks.append)
        self.first = threading.Event()
        self.final: common_pb2.FinalResult | None = None
        self.error: ServiceError | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for response in self._responses:
                self.first.set()
                if response.HasField("final"):
                    self.final = response.final
        except ServiceError as error:
            self.error = error
        finally:
            self.first.set()

    def leave(self) -> None:
        for callback in self._callbacks:
            callback()

    def finish(self) -> Served:
        self._thread.join(BOUND_S)
        assert not self._thread.is_alive(), "a request still runs past its bound"
        return self


@pytest.fixture
def engine_and_service() -> Iterator[tuple[LLMEngine, EngineLoop, AggregatedService]]:
    cache = CacheConfig(tokens_per_block=16, num_blocks=16)
    engine = LLMEngine(
        EngineConfig(dtype="float32", cache=cache), QueueLimits(max_num_waiting=1, max_wait_s=60.0)
    )
    loop = EngineLoop(engine)
    loop.start()
    limits = ModelLimits(
        vocab_size=engine.model_config.vocab_size,
        max_model_len=engine.model_config.max_position_embeddings,
        eos_token_id=engine.tokenizer.eos_token_id,
    )
    yield (
        engine,
        loop,
        AggregatedService(loop, engine.tokenizer, limits, ShutdownGate(), engine_timeout_s=BOUND_S),
    )
    loop.stop()


def test_past_the_queue_bound_the_client_gets_resource_exhausted(
    engine_and_service: tuple[LLMEngine, EngineLoop, AggregatedService],
) -> None:
    engine, loop, service = engine_and_service
    fill = Served(service, prompt(1), FILL)
    assert fill.first.wait(BOUND_S) and fill.error is None
    waiter = Served(service, prompt(2), SMALL)
    wait_for(lambda: loop.call(lambda engine: len(engine.scheduler.waiting)) == 1, "the small request queued")
    refused = Served(service, prompt(3), SMALL).finish()
    assert refused.error is not None and refused.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.error.message == (
        "aggregated server: queue full: 1 requests already wait for KV blocks or batch room "
        "(max_queued_requests 1)"
    )
    assert waiter.final is None and waiter.error is None  # still waiting its turn
    fill.leave()
    fill.finish()
    waiter.finish()
    assert waiter.error is None and waiter.final is not None and len(waiter.final.beams) == 1
    assert loop.call(lambda engine: engine.num_blocks_in_use()) == 0
    loop.call(lambda engine: engine.check_integrity())
