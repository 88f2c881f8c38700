"""Hybrid-model prefix reuse at the cache level: snapshots in the prefix tree, the match pruned to
a snapshot, the `num_tokens_before_hybrid_pruning` diagnostic, and the state-slot pool.

Block 32 with partial reuse and partial commit on (the DESIGN.md worked case), exact block ids.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, SamplingParams
from engine.kv_cache import KVCacheManager
from engine.kv_groups import KVGroups
from engine.models.loader import tiny_hybrid_model_config
from engine.request import Request, make_decoder
from engine.scheduler import Scheduler
from engine.state_pool import OutOfStateSlotsError, StatePool

T = 32


def make_cache(has_recurrent_state: bool = True) -> KVCacheManager:
    config = CacheConfig(
        tokens_per_block=T, num_blocks=16, enable_partial_reuse=True, enable_partial_commit=True
    )
    return KVCacheManager(config, has_recurrent_state=has_recurrent_state)


def tokens(length: int, offset: int) -> list[int]:
    return [(offset + 5 * index) % 251 for index in range(length)]


def prefill_and_release(cache: KVCacheManager, prompt: list[int], with_snapshots: bool = True) -> list[int]:
    """What an engine does for a prompt: allocate, (forward), commit with the snapshots it stored."""
    allocation = cache.allocate_prompt(prompt)
    snapshots = cache.prompt_snapshots(allocation.table, allocation.num_cached_tokens, len(prompt))
    cache.commit(allocation.table, prompt, snapshot_lens=[n for n, _ in snapshots] if with_snapshots else [])
    block_ids = list(allocation.table.block_ids)
    cache.free(allocation.table)
    cache.check_integrity([])
    return block_ids


def test_pages_cover_48_but_the_latest_snapshot_sits_at_32() -> None:
    cache = make_cache()
    first = tokens(49, 0)
    allocation = cache.allocate_prompt(first)
    # Snapshots at the end of block 0 and, since the last block is published, at the prompt's end.
    assert cache.prompt_snapshots(allocation.table, 0, 49) == [(32, 0), (49, 1)]
    cache.free(allocation.table)
    assert prefill_and_release(cache, first) == [0, 1]
    assert cache.tree.snapshot_len(0) == 32 and cache.tree.snapshot_len(1) == 49

    # The lookup is 52 tokens; pages match 32 + 16 of block 1's 17; block 1's snapshot covers 49.
    second = first[:48] + [250, 249, 248, 247, 246]
    allocation = cache.allocate_prompt(second)
    assert len(second) - 1 == 52
    assert allocation.num_tokens_before_hybrid_pruning == 48
    assert allocation.num_cached_tokens == 32
    assert allocation.snapshot_block_id == 0
    assert allocation.copies == []  # pruned to a block end: no partly reused block to copy
    assert allocation.table.block_ids == [0, 2]
    assert cache.stats.hybrid_pruned_tokens == 16
    cache.check_integrity([allocation.table])


def test_snapshot_and_pages_agree_at_64() -> None:
    cache = make_cache()
    first = tokens(65, 3)
    assert prefill_and_release(cache, first) == [0, 1, 2]
    # The lookup is 69 tokens and leaves the cached prompt at token 64.
    second = first[:64] + [250, 249, 248, 247, 246, 245]
    allocation = cache.allocate_prompt(second)
    assert allocation.num_tokens_before_hybrid_pruning == 64
    assert allocation.num_cached_tokens == 64
    assert allocation.snapshot_block_id == 1
    assert allocation.table.block_ids[:2] == [0, 1]
    cache.check_integrity([allocation.table])


def test_pages_without_snapshots_are_not_reused_and_the_diagnostic_says_so() -> None:
    cache = make_cache()
    first = tokens(80, 1)
    prefill_and_release(cache, first, with_snapshots=False)  # e.g. pages pulled, no state shipped
    allocation = cache.allocate_prompt(first[:70] + [7])
    assert allocation.num_tokens_before_hybrid_pruning == 70
    assert allocation.num_cached_tokens == 0 and allocation.snapshot_block_id is None
    cache.free(allocation.table)
    cache.check_integrity([])


def test_a_model_without_recurrent_layers_reuses_what_the_pages_hold() -> None:
    cache = make_cache(has_recurrent_state=False)
    first = tokens(49, 0)
    allocation = cache.allocate_prompt(first)
    cache.commit(allocation.table, first)
    cache.free(allocation.table)
    allocation = cache.allocate_prompt(first[:48] + [250, 249, 248, 247, 246])
    assert allocation.num_tokens_before_hybrid_pruning == allocation.num_cached_tokens == 48
    assert cache.tree.num_snapshots() == 0
    cache.check_integrity([allocation.table])


def test_eviction_drops_the_snapshot_with_its_block() -> None:
    cache = KVCacheManager(CacheConfig(tokens_per_block=T, num_blocks=2), has_recurrent_state=True)
    prefill_and_release(cache, tokens(33, 0))  # block 0 published with its snapshot, block 1 free
    assert cache.tree.snapshot_len(0) == 32
    allocation = cache.allocate_prompt(tokens(64, 100))  # needs both blocks: evicts block 0
    assert cache.tree.num_snapshots() == 0
    cache.check_integrity([allocation.table])


def test_record_snapshot_refuses_a_position_that_is_not_the_block_end() -> None:
    cache = make_cache()
    prefill_and_release(cache, tokens(40, 0))
    with pytest.raises(ValueError, match="cannot end at token"):
        cache.tree.record_snapshot(0, 40)
    with pytest.raises(ValueError, match="not published"):
        cache.tree.record_snapshot(5, 32)


def make_pool(num_slots: int) -> StatePool:
    return StatePool(tiny_hybrid_model_config(), num_slots, 4, torch.float64, "cpu")


def test_fork_copies_each_parent_state_and_reads_before_writing() -> None:
    pool = make_pool(4)
    slot_ids = pool.allocate_slots(3)
    for index, slot_id in enumerate(slot_ids):
        pool.slots[slot_id].fill_(float(index + 1))
    pool.fork(slot_ids, [2, 0, 0])  # beam 0 continues old beam 2; beams 1, 2 continue old beam 0
    assert [float(pool.slots[slot_id].flatten()[0]) for slot_id in slot_ids] == [3.0, 1.0, 1.0]
    pool.check_integrity(slot_ids)


def test_state_bytes_round_trip_and_slot_bookkeeping() -> None:
    pool = make_pool(2)
    first, second = pool.allocate_slots(2)
    pool.slots[first].normal_()
    pool.write(second, pool.read(first))
    assert torch.equal(pool.slots[first], pool.slots[second])
    with pytest.raises(OutOfStateSlotsError):
        pool.allocate_slots(1)
    with pytest.raises(AssertionError, match="held twice"):
        pool.check_integrity([first, first])
    pool.free_slots([first, second])
    pool.check_integrity([])
    with pytest.raises(ValueError, match="already free"):
        pool.free_slots([first])


def test_admission_counts_beam_width_state_slots() -> None:
    cache = KVCacheManager(CacheConfig(tokens_per_block=T, num_blocks=16), has_recurrent_state=True)
    pool = make_pool(5)
    scheduler = Scheduler(KVGroups.of_manager(cache), 8, lambda copies: None, pool)
    params = SamplingParams(beam_width=3, max_new_tokens=4)
    requests = [
        Request(f"r{index}", tokens(10, index), params, make_decoder(params, None, 0)) for index in range(2)
    ]
    for request in requests:
        scheduler.add_waiting(request)
    batch = scheduler.schedule()
    assert [chunk.request for chunk in batch.prefills] == [requests[0]]
    assert len(requests[0].state_slot_ids) == 3
    assert list(scheduler.waiting) == [requests[1]]  # 2 free slots < 3 beams
    pool.check_integrity(scheduler.live_slot_ids())
    scheduler.remove(requests[0])
    assert [chunk.request for chunk in scheduler.schedule().prefills] == [requests[1]]
    pool.check_integrity(scheduler.live_slot_ids())


def test_state_bytes_for_counts_conv_layers_only() -> None:
    config = tiny_hybrid_model_config()  # 2 convolution layers, K = 3, E = 64
    assert StatePool.state_bytes_for(config, torch.float64) == 2 * 2 * 64 * 8 == make_pool(1).state_bytes
