from __future__ import annotations

import pytest

from engine.block_allocator import BlockAllocator, OutOfBlocksError


def snapshot(allocator: BlockAllocator) -> tuple[list[int], list[int], int, list[bool]]:
    return (
        [allocator.ref_count(block_id) for block_id in range(allocator.num_blocks)],
        allocator.cached_block_ids(),
        allocator.num_free_blocks(),
        [allocator.is_published(block_id) for block_id in range(allocator.num_blocks)],
    )


def test_allocate_takes_lowest_ids_and_reuses_freed_ones() -> None:
    allocator = BlockAllocator(6)
    assert allocator.allocate(3) == [0, 1, 2]
    allocator.check_integrity()
    allocator.free([1])
    allocator.check_integrity()
    assert allocator.allocate(2) == [1, 3]
    allocator.check_integrity()
    assert allocator.num_blocks_in_use() == 4
    assert allocator.num_free_blocks() == 2


def test_allocate_is_all_or_nothing() -> None:
    allocator = BlockAllocator(4)
    allocator.allocate(3)
    before = snapshot(allocator)
    with pytest.raises(OutOfBlocksError):
        allocator.allocate(2)
    allocator.check_integrity()
    assert snapshot(allocator) == before
    assert allocator.allocate(1) == [3]
    allocator.check_integrity()


def test_cached_blocks_are_evicted_least_recently_used_first() -> None:
    evicted: list[int] = []
    allocator = BlockAllocator(4, on_evict=evicted.append)
    assert allocator.allocate(3) == [0, 1, 2]
    for block_id in (0, 1, 2):
        allocator.mark_published(block_id)
    for block_id in (1, 0, 2):
        allocator.decref(block_id)
        allocator.check_integrity()
    assert allocator.cached_block_ids() == [1, 0, 2]
    assert allocator.num_free_blocks() == 4 and allocator.num_blocks_in_use() == 0
    # The truly free block goes before any cached one.
    assert allocator.allocate(1) == [3]
    assert evicted == []
    assert allocator.allocate(2) == [1, 0]
    allocator.check_integrity()
    assert evicted == [1, 0]
    assert not allocator.is_published(1) and not allocator.is_published(0)
    assert allocator.cached_block_ids() == [2]


def test_sharing_a_cached_block_revives_it_and_release_makes_it_most_recent() -> None:
    allocator = BlockAllocator(3)
    allocator.allocate(3)
    for block_id in (0, 1, 2):
        allocator.mark_published(block_id)
        allocator.decref(block_id)
    assert allocator.cached_block_ids() == [0, 1, 2]
    allocator.incref(0)
    allocator.check_integrity()
    assert allocator.cached_block_ids() == [1, 2]
    assert allocator.num_blocks_in_use() == 1
    allocator.decref(0)
    allocator.check_integrity()
    assert allocator.cached_block_ids() == [1, 2, 0]


def test_referenced_block_is_never_evicted() -> None:
    evicted: list[int] = []
    allocator = BlockAllocator(2, on_evict=evicted.append)
    allocator.allocate(2)
    allocator.mark_published(0)
    allocator.mark_published(1)
    allocator.decref(1)
    assert allocator.allocate(1) == [1]
    with pytest.raises(OutOfBlocksError):
        allocator.allocate(1)
    allocator.check_integrity()
    assert evicted == [1]
    assert allocator.ref_count(0) == 1 and allocator.is_published(0)


def test_misuse_is_rejected_without_change() -> None:
    allocator = BlockAllocator(2)
    allocator.allocate(1)
    before = snapshot(allocator)
    with pytest.raises(ValueError):
        allocator.incref(1)  # free: nothing to share
    with pytest.raises(ValueError):
        allocator.decref(1)
    with pytest.raises(ValueError):
        allocator.mark_published(1)
    with pytest.raises(ValueError):
        allocator.allocate(-1)
    allocator.check_integrity()
    assert snapshot(allocator) == before


def test_unpublishing_a_cached_block_frees_it() -> None:
    allocator = BlockAllocator(2)
    allocator.allocate(1)
    allocator.mark_published(0)
    allocator.decref(0)
    assert allocator.cached_block_ids() == [0]
    allocator.unmark_published(0)
    allocator.check_integrity()
    assert allocator.cached_block_ids() == []
    assert allocator.allocate(2) == [0, 1]


def test_check_integrity_catches_corruption() -> None:
    allocator = BlockAllocator(3)
    allocator.allocate(1)
    allocator._ref_counts[2] = 1  # referenced while on the free heap
    with pytest.raises(AssertionError):
        allocator.check_integrity()
    allocator._ref_counts[2] = 0
    allocator.check_integrity()
    allocator._ref_counts[0] = -1
    with pytest.raises(AssertionError):
        allocator.check_integrity()


def test_owners_share_the_ids_and_each_gets_its_own_evictions() -> None:
    """KV groups share one allocator: a block belongs to the owner that allocated it, its
    eviction reaches that owner's callback, and blocks in use are counted per owner."""
    evicted: dict[str, list[int]] = {"a": [], "b": []}
    allocator = BlockAllocator(4)
    first = allocator.add_owner(evicted["a"].append)
    second = allocator.add_owner(evicted["b"].append)
    assert allocator.allocate(2, first) == [0, 1] and allocator.allocate(2, second) == [2, 3]
    assert (allocator.num_blocks_in_use(first), allocator.num_blocks_in_use(second)) == (2, 2)
    for block_id in (1, 3):
        allocator.mark_published(block_id)
    allocator.free([3, 1, 0, 2])  # cached in release order: 3 (second's), then 1 (first's)
    assert allocator.num_published_blocks(first) == allocator.num_published_blocks(second) == 1
    assert allocator.allocate(3, first) == [0, 2, 3]  # the free ones, then the oldest cached: 3
    assert evicted == {"a": [], "b": [3]} and allocator.owner(3) == first
    assert (allocator.num_blocks_in_use(first), allocator.num_blocks_in_use(second)) == (3, 0)
    allocator.check_integrity()
