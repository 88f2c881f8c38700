"""The context worker's service on a real engine and loop thread (loopback transfer agent):
prefills that arrive together run in one forward pass and hand off what `prefill()` alone gives;
a prefill past the engine timeout is aborted part-way and leaves no block held."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from beamsplit.server.engine_loop import EngineLoop, EngineLoopError
from beamsplit.server.metrics import ServerMetrics
from context_worker.service import ContextService, HeldPrompt
from engine import CacheConfig, EngineConfig, LLMEngine
from transfer import LoopbackHub, LoopbackTransferAgent, MemoryRegion

CONFIG = EngineConfig(
    model="tiny",
    dtype="float32",
    cache=CacheConfig(tokens_per_block=16, num_blocks=256),
    max_num_seqs=8,
    max_num_batched_tokens=64,
    batch_invariant=True,  # batched prefills then equal prefills alone bit for bit
)
WAIT_S = 30.0  # bound on every wait below; never reached when the code is right


def prompt_of(length: int, offset: int) -> list[int]:
    return [(offset + 7 * index) % 250 for index in range(length)]


@dataclass
class ContextSide:
    engine: LLMEngine
    loop: EngineLoop
    agent: LoopbackTransferAgent
    forwards: list[int]  # sequences fed by each forward pass
    forward_delay_s: list[float]  # a sleep before each forward (test hook), one element

    def service(self, engine_timeout_s: float = WAIT_S) -> ContextService:
        metrics = ServerMetrics("context")
        return ContextService(self.loop, self.agent, "kv", metrics, engine_timeout_s=engine_timeout_s)

    def blocks_in_use(self) -> int:
        return self.loop.call(lambda engine: engine.num_blocks_in_use())

    def wait_for_zero_blocks(self) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.blocks_in_use() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.blocks_in_use() == 0
        assert not self.loop.call(lambda engine: engine.has_unfinished())
        self.loop.call(lambda engine: engine.check_integrity())


@pytest.fixture
def side() -> Iterator[ContextSide]:
    engine = LLMEngine(CONFIG)
    forwards: list[int] = []
    delay = [0.0]
    compute = engine.runner.forward

    def counted(seqs: Any) -> Any:
        forwards.append(len(seqs))
        time.sleep(delay[0])
        return compute(seqs)

    engine.runner.forward = counted  # type: ignore[method-assign]
    loop = EngineLoop(engine)
    loop.start()
    agent = LoopbackTransferAgent(LoopbackHub())
    region = engine.kv_region()
    agent.register("kv", MemoryRegion(region.address, region.page_bytes, region.num_pages, region.device))
    try:
        yield ContextSide(engine, loop, agent, forwards, delay)
    finally:
        loop.stop()
        agent.close()


def test_prefills_that_arrive_together_share_one_forward(side: ContextSide) -> None:
    service = side.service()
    prompts = [prompt_of(20, 1), prompt_of(33, 2), prompt_of(9, 3)]
    reference = LLMEngine(CONFIG)
    expected = [reference.prefill(f"r{index}#0", prompt, 4) for index, prompt in enumerate(prompts)]
    # Hold the engine thread until every prefill has queued its add behind it.
    gate, holding = threading.Event(), threading.Event()

    def hold(engine: Any) -> None:
        holding.set()
        gate.wait(WAIT_S)

    side.loop.submit(hold)
    # The engine thread must be inside hold() before the adds queue: had it not yet taken hold()
    # off the queue, it would take the first adds with it and run them before the others came.
    assert holding.wait(WAIT_S)
    held: dict[int, HeldPrompt] = {}

    def run(index: int) -> None:
        held[index] = service.prefill(f"r{index}", 0, prompts[index], 4, b"", lease_s=WAIT_S)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + WAIT_S
    while side.loop.num_pending_commands < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.set()
    for thread in threads:
        thread.join(WAIT_S)
    try:
        assert side.forwards == [3], "the three prompts (62 tokens) ran in one forward"
        for index, result in enumerate(expected):
            assert held[index].candidate_ids == result.candidate_ids
            assert held[index].candidate_logprobs == result.candidate_logprobs
            assert held[index].page_ids == result.block_ids
            assert held[index].prompt_len == len(prompts[index])
    finally:
        for hold in held.values():
            service.release(hold.transfer_id, "test done")
        service.shutdown()
    side.wait_for_zero_blocks()


def test_prefill_past_the_engine_timeout_is_aborted_part_way(side: ContextSide) -> None:
    # 1000 tokens in chunks of 64 is 16 forwards of at least 0.1 s each: far past the 0.5 s bound.
    side.forward_delay_s[0] = 0.1
    service = side.service(engine_timeout_s=0.5)
    try:
        with pytest.raises(EngineLoopError, match="did not finish the prefill"):
            service.prefill("slow", 0, prompt_of(1000, 4), 4, b"", lease_s=WAIT_S)
        assert service.num_holds == 0
        side.wait_for_zero_blocks()
        assert len(side.forwards) < 16, "dropped before its end"
        # What its chunks wrote stays published (cached, evictable): 64 tokens, 4 whole blocks, each.
        cached = side.loop.call(lambda engine: engine.kv_cache.allocator.num_cached_blocks())
        assert cached == len(side.forwards) * 64 // 16
    finally:
        service.shutdown()
