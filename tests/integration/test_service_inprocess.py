"""The workers' plain classes wired together in one process: real engines on their loop threads,
the loopback transfer agent instead of UCX. Fast checks of the handoff logic (parity, pages pulled,
cancel during a stalled pull, lease lapse) that the process-level tests repeat over UCX.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from beamsplit.server.engine_loop import EngineLoop
from beamsplit.server.metrics import ServerMetrics
from beamsplit.server.server_common import ShutdownGate
from beamsplit.v1 import worker_pb2
from beamsplit.wire import ServiceError
from context_worker.service import ContextService, HeldPrompt
from engine import CacheConfig, EngineConfig, LLMEngine, RequestOutput, SamplingParams
from generation_worker.service import GenerationService, GenerationTimeouts, LocalLayout
from transfer import LoopbackHub, LoopbackTransferAgent, MemoryRegion

BLOCK = 32
CONFIG = EngineConfig(
    model="tiny", dtype="float64", cache=CacheConfig(tokens_per_block=BLOCK, num_blocks=256)
)


class DirectContextClient:
    """The generation side's Release/Heartbeat, called straight on the context service."""

    def __init__(self, service: ContextService) -> None:
        self._service = service

    def release(self, address: str, transfer_id: str, reason: str) -> None:
        self._service.release(transfer_id, reason)

    def heartbeat(self, address: str, transfer_id: str, extend_s: float) -> bool:
        return self._service.heartbeat(transfer_id, extend_s)[0]


@dataclass
class Pair:
    hub: LoopbackHub
    context_engine: LLMEngine
    generation_engine: LLMEngine
    context_loop: EngineLoop
    generation_loop: EngineLoop
    context_agent: LoopbackTransferAgent
    context: ContextService
    generation: GenerationService

    def blocks_in_use(self) -> tuple[int, int]:
        return (
            self.context_loop.call(lambda engine: engine.num_blocks_in_use()),
            self.generation_loop.call(lambda engine: engine.num_blocks_in_use()),
        )

    def wait_for_zero_blocks(self, timeout_s: float = 3.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.blocks_in_use() != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.blocks_in_use() == (0, 0)
        self.context_loop.call(lambda engine: engine.check_integrity())
        self.generation_loop.call(lambda engine: engine.check_integrity())


def start_side(
    hub: LoopbackHub, config: EngineConfig = CONFIG
) -> tuple[LLMEngine, EngineLoop, LoopbackTransferAgent]:
    engine = LLMEngine(config)
    loop = EngineLoop(engine)
    loop.start()
    agent = LoopbackTransferAgent(hub)
    region = engine.kv_region()
    agent.register("kv", MemoryRegion(region.address, region.page_bytes, region.num_pages, region.device))
    return engine, loop, agent


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    hub = LoopbackHub()
    context_engine, context_loop, context_agent = start_side(hub)
    generation_engine, generation_loop, generation_agent = start_side(hub)
    context = ContextService(context_loop, context_agent, "kv", ServerMetrics("context"), default_lease_s=5.0)
    layout = LocalLayout("kv", BLOCK, context_engine.kv_region().page_bytes, CONFIG.dtype, CONFIG.model)
    generation = GenerationService(
        generation_loop,
        generation_agent,
        layout,
        DirectContextClient(context),  # type: ignore[arg-type]
        ServerMetrics("generation"),
        ShutdownGate(),
        GenerationTimeouts(pull_s=5.0, heartbeat_interval_s=0.2, lease_extend_s=1.0),
    )
    yield Pair(
        hub,
        context_engine,
        generation_engine,
        context_loop,
        generation_loop,
        context_agent,
        context,
        generation,
    )
    context.shutdown()
    context_loop.stop()
    generation_loop.stop()
    context_agent.close()
    generation_agent.close()


def handoff_for(
    pair: Pair, request_id: str, prompt_ids: list[int], params: SamplingParams, lease_s: float = 0.0
) -> worker_pb2.Handoff:
    held = pair.context.prefill(request_id, 0, prompt_ids, params.num_candidates, b"", lease_s=lease_s)
    return worker_pb2.Handoff(
        request_id=request_id,
        transfer_id=held.transfer_id,
        ucx_address=held.ucx_address,
        context_address="direct",
        layout=worker_pb2.PageLayout(
            region="kv",
            tokens_per_block=BLOCK,
            page_bytes=pair.context_engine.kv_region().page_bytes,
            dtype="float64",
        ),
        page_ids=held.page_ids,
        prompt_len=held.prompt_len,
        candidate_ids=held.candidate_ids,
        candidate_logprobs=held.candidate_logprobs,
        secret=held.secret,
        reused_tokens=held.reused_tokens,
    )


def prompt(length: int, offset: int) -> list[int]:
    return [(offset + 7 * index) % 256 for index in range(length)]


@pytest.mark.parametrize(("prompt_len", "beam_width"), [(64, 1), (67, 2), (64, 4), (67, 4)])
def test_handoff_matches_one_engine(pair: Pair, prompt_len: int, beam_width: int) -> None:
    prompt_ids = prompt(prompt_len, offset=prompt_len * 10 + beam_width)
    params = SamplingParams(beam_width=beam_width, max_new_tokens=6)
    handoff = handoff_for(pair, f"parity-{prompt_len}-{beam_width}", prompt_ids, params)
    outputs = list(pair.generation.generate(handoff, prompt_ids, params, b"", is_client_gone=lambda: False))
    final = outputs[-1]
    assert final.finished
    reference = LLMEngine(CONFIG).generate(prompt_ids, params)
    assert [beam.token_ids for beam in final.beams] == [beam.token_ids for beam in reference.beams]
    assert [beam.score for beam in final.beams] == [beam.score for beam in reference.beams]
    assert final.stats["transferred_blocks"] == -(-prompt_len // BLOCK)
    pair.wait_for_zero_blocks()


def test_second_send_pulls_only_missing_pages(pair: Pair) -> None:
    prompt_ids = prompt(67, offset=999)
    params = SamplingParams(beam_width=2, max_new_tokens=4)
    pulled = []
    for attempt in range(2):
        handoff = handoff_for(pair, f"reuse-{attempt}", prompt_ids, params)
        final = list(
            pair.generation.generate(handoff, prompt_ids, params, b"", is_client_gone=lambda: False)
        )[-1]
        pulled.append(
            (
                handoff.reused_tokens,
                final.stats["generation_reused_tokens"],
                final.stats["transferred_blocks"],
            )
        )
    assert pulled == [(0, 0, 3), (64, 64, 1)]
    pair.wait_for_zero_blocks()


def test_cancel_during_a_stalled_pull_frees_both_sides(pair: Pair) -> None:
    prompt_ids = prompt(67, offset=4242)
    params = SamplingParams(beam_width=2, max_new_tokens=4)
    handoff = handoff_for(pair, "stalled", prompt_ids, params)
    pair.hub.stall(pair.context_agent.address)
    cancel_at = time.monotonic() + 0.5
    try:
        with pytest.raises(ServiceError) as raised:
            list(
                pair.generation.generate(
                    handoff, prompt_ids, params, b"", lambda: time.monotonic() > cancel_at
                )
            )
    finally:
        pair.hub.stall(pair.context_agent.address, False)
    assert raised.value.code == grpc.StatusCode.CANCELLED
    pair.wait_for_zero_blocks()


def test_unpulled_prompt_is_released_when_its_lease_lapses(pair: Pair) -> None:
    pair.context.prefill("orphan", 0, prompt(67, offset=77), 4, b"", lease_s=0.3)
    assert pair.blocks_in_use()[0] == 3
    pair.wait_for_zero_blocks(timeout_s=3.0)


def test_a_queued_request_keeps_its_prompt_held_past_the_lease_and_runs_when_blocks_free(pair: Pair) -> None:
    """256 blocks; FILL's bound is 2 + 4 * 62 = 250, so WAITER (2 + 4 * 2 = 10) queues. Its prompt
    is held under a 0.5 s lease: only the queue's heartbeats keep it alive for the pull."""
    fill_ids, waiter_ids = prompt(67, offset=31), prompt(67, offset=32)
    fill_params = SamplingParams(beam_width=4, max_new_tokens=2048 - 67, ignore_eos=True)
    waiter_params = SamplingParams(beam_width=4, max_new_tokens=40)
    stop_fill = threading.Event()
    fill_outputs = pair.generation.generate(
        handoff_for(pair, "fill", fill_ids, fill_params), fill_ids, fill_params, b"", stop_fill.is_set
    )
    assert not next(fill_outputs).finished  # decoding: its bound is promised
    waiter_handoff = handoff_for(pair, "waiter", waiter_ids, waiter_params, lease_s=0.5)
    finals: list[RequestOutput] = []
    waiter = threading.Thread(
        target=lambda: finals.extend(
            list(pair.generation.generate(waiter_handoff, waiter_ids, waiter_params, b"", lambda: False))[-1:]
        ),
        daemon=True,
    )
    waiter.start()
    try:
        deadline = time.monotonic() + 10.0
        while pair.generation.admission.num_waiting == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pair.generation.admission.num_waiting == 1
        time.sleep(1.5)  # three leases long: the hold lives on heartbeats alone
        assert pair.context.num_holds == 1 and waiter.is_alive()
    finally:
        stop_fill.set()
        with pytest.raises(ServiceError):
            list(fill_outputs)
    waiter.join(30.0)
    assert not waiter.is_alive() and len(finals) == 1
    final = finals[0]
    assert final.finished and len(final.beams) == 4 and final.stats["transferred_blocks"] == 3
    assert pair.generation.admission.num_waiting == 0
    pair.generation.admission.check_integrity()
    pair.wait_for_zero_blocks()


def test_a_prefill_that_does_not_fit_waits_for_a_hold_to_end() -> None:
    """A context worker of 8 blocks pinned whole by two 128-token prompts: a third prompt waits in
    its queue and is prefilled once one hold ends; a caller that leaves while queued takes nothing
    with it."""
    small = EngineConfig(
        model="tiny", dtype="float64", cache=CacheConfig(tokens_per_block=BLOCK, num_blocks=8)
    )
    engine, loop, agent = start_side(LoopbackHub(), small)
    context = ContextService(loop, agent, "kv", ServerMetrics("context"), default_lease_s=30.0)
    try:
        held = [
            context.prefill(f"pin-{index}", 0, prompt(128, offset=500 + index), 1, b"", 30.0)
            for index in range(2)
        ]
        assert loop.call(lambda engine: engine.num_blocks_in_use()) == 8
        results: list[HeldPrompt] = []
        waiter = threading.Thread(
            target=lambda: results.append(context.prefill("later", 0, prompt(67, offset=600), 4, b"", 30.0)),
            daemon=True,
        )
        waiter.start()
        deadline = time.monotonic() + 10.0
        while context.admission.num_waiting == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert context.admission.num_waiting == 1 and not results
        with pytest.raises(ServiceError) as gone:
            context.prefill("gone", 0, prompt(67, offset=601), 4, b"", 30.0, is_caller_gone=lambda: True)
        assert gone.value.code == grpc.StatusCode.CANCELLED and context.admission.num_waiting == 1
        assert context.release(held[0].transfer_id, "test")
        waiter.join(30.0)
        assert not waiter.is_alive() and len(results) == 1 and context.admission.num_waiting == 0
        for hold in (held[1], results[0]):
            assert context.release(hold.transfer_id, "test")
        context.admission.check_integrity()
        assert loop.call(lambda engine: engine.num_blocks_in_use()) == 0
        loop.call(lambda engine: engine.check_integrity())
    finally:
        context.shutdown()
        loop.stop()
        agent.close()
