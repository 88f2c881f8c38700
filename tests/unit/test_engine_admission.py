"""Admission by the block bound in the engine: a generation-side reservation that can never fit is
told apart from one that does not fit now, reservations still pulling count their bound, a
refusal changes nothing (counters included); the scheduler's waiting queue sheds past its
`QueueLimits` (length, then wait), each shed request holding nothing.

Block 16; a 40-token prompt with W = 2 and 40 new tokens is bounded by 2 + 2 * (5 - 2) = 8 blocks.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from engine import (
    CacheConfig,
    EngineConfig,
    LLMEngine,
    OutOfBlocksError,
    PoolTooSmallError,
    RequestOutput,
    SamplingParams,
)
from engine.scheduler import QueueLimits

PARAMS = SamplingParams(beam_width=2, max_new_tokens=40, ignore_eos=True)


def make_engine(num_blocks: int, queue_limits: QueueLimits | None = None) -> LLMEngine:
    cache = CacheConfig(tokens_per_block=16, num_blocks=num_blocks)
    return LLMEngine(EngineConfig(dtype="float32", cache=cache), queue_limits)


def prompt_of(length: int, offset: int) -> list[int]:
    return [(offset + 7 * index) % 250 for index in range(length)]


def run_to_completion(engine: LLMEngine) -> dict[str, RequestOutput]:
    outputs: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
        engine.check_integrity()
    return outputs


def test_a_reservation_larger_than_the_pool_is_told_apart_and_holds_nothing() -> None:
    engine = make_engine(num_blocks=7)
    with pytest.raises(PoolTooSmallError, match=r"'big' needs up to 8 blocks, more than the pool's 7 in all"):
        engine.reserve_prompt("big", prompt_of(40, 1), params=PARAMS)
    assert engine.num_blocks_in_use() == 0
    engine.check_integrity()


def test_a_prompt_larger_than_the_pool_is_told_apart_on_the_context_side() -> None:
    engine = make_engine(num_blocks=2)
    with pytest.raises(
        PoolTooSmallError, match=r"'long' needs 3 blocks for its prompt, more than the pool's 2 in all"
    ):
        engine.prefill("long", prompt_of(33, 1), 4)
    engine.prefill("held", prompt_of(32, 1), 4)  # fits, and pins both blocks
    with pytest.raises(OutOfBlocksError) as refused:
        engine.prefill("later", prompt_of(20, 2), 4)
    assert not isinstance(refused.value, PoolTooSmallError)  # not now: it fits once "held" ends
    engine.release_prefill("held")
    engine.check_integrity()
    assert engine.num_blocks_in_use() == 0


def test_reservations_still_pulling_count_their_bound_and_a_refusal_changes_nothing() -> None:
    engine = make_engine(num_blocks=12)
    first = engine.reserve_prompt("first", prompt_of(40, 1), params=PARAMS)
    assert len(first.block_ids) == 3  # 5 more promised: 12 - 3 = 9 free
    counters_before = engine.counters()
    stats_before = replace(engine.kv_cache.stats)
    # 3 more now would leave 6 free for 5 + 5 promised: not now (it would fit alone).
    with pytest.raises(OutOfBlocksError, match=r"'second' needs up to 8 blocks; the pool is full") as refused:
        engine.reserve_prompt("second", prompt_of(40, 2), params=PARAMS)
    assert not isinstance(refused.value, PoolTooSmallError)
    assert engine.num_blocks_in_use() == 3
    assert engine.counters() == counters_before and engine.kv_cache.stats == stats_before
    engine.check_integrity()
    engine.cancel_reservation("first")
    second = engine.reserve_prompt("second", prompt_of(40, 2), params=PARAMS)
    assert len(second.block_ids) == 3
    engine.cancel_reservation("second")
    assert engine.num_blocks_in_use() == 0
    engine.check_integrity()


def test_the_waiting_queue_sheds_its_youngest_past_its_length() -> None:
    engine = make_engine(num_blocks=8, queue_limits=QueueLimits(max_num_waiting=1))
    for name, offset in (("a", 1), ("b", 2), ("c", 3)):
        engine.add_request(name, prompt_of(40, offset), PARAMS)
    first = {output.request_id: output for output in engine.step()}
    engine.check_integrity()
    # a fills the pool; b waits (the one place in the queue); c is refused with nothing held.
    assert set(first) == {"a", "c"} and first["c"].finished and not first["a"].finished
    assert first["c"].error == (
        "queue full: 1 requests already wait for KV blocks or batch room (max_queued_requests 1)"
    )
    assert [request.request_id for request in engine.scheduler.waiting] == ["b"]
    assert engine.counters().num_waiting_requests == 1
    outputs = run_to_completion(engine)
    assert outputs["a"].error is None and outputs["b"].error is None and len(outputs["b"].beams) == 2
    assert engine.num_blocks_in_use() == 0


def test_the_waiting_queue_sheds_a_request_past_its_wait() -> None:
    engine = make_engine(num_blocks=8, queue_limits=QueueLimits(max_wait_s=0.5))
    engine.add_request("a", prompt_of(40, 1), PARAMS)
    engine.add_request("b", prompt_of(40, 2), PARAMS)
    assert {output.request_id for output in engine.step()} == {"a"}  # b waits for a's blocks
    threading.Event().wait(0.6)
    outputs = {output.request_id: output for output in engine.step()}
    error = outputs["b"].error
    assert outputs["b"].finished and error is not None
    assert error.startswith("waited ") and error.endswith(
        " s in the queue for KV blocks or batch room (max_queue_wait_s 0.5)"
    ), error
    engine.abort("a")
    engine.check_integrity()
    assert engine.num_blocks_in_use() == 0 and not engine.has_unfinished()


def test_queue_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_num_waiting"):
        QueueLimits(max_num_waiting=-1)
    with pytest.raises(ValueError, match="max_wait_s"):
        QueueLimits(max_wait_s=0.0)
