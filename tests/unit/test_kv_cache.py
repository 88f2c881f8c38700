from __future__ import annotations

import random

import pytest

from engine.config import CacheConfig
from engine.kv_cache import BlockTable, CopyOp, KVCacheManager, OutOfBlocksError, num_distinct_blocks

Snapshot = tuple[list[int], list[int], int, list[bytes | None]]


def make_cache(
    num_blocks: int = 16, tokens_per_block: int = 32, reuse: bool = False, commit: bool = False
) -> KVCacheManager:
    config = CacheConfig(
        tokens_per_block, num_blocks, enable_partial_reuse=reuse, enable_partial_commit=commit
    )
    return KVCacheManager(config)


def snapshot(cache: KVCacheManager) -> Snapshot:
    block_ids = range(cache.allocator.num_blocks)
    return (
        [cache.allocator.ref_count(block_id) for block_id in block_ids],
        cache.allocator.cached_block_ids(),
        cache.num_free_blocks(),
        [cache.tree.key_of_block(block_id) for block_id in block_ids],
    )


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


@pytest.mark.parametrize(
    ("reuse", "commit", "reused", "table_ids", "copies"),
    [
        (False, True, 32, [0, 2], []),
        (False, False, 32, [0, 2], []),
        (True, True, 48, [0, 2], [CopyOp(1, 2)]),
        (True, False, 32, [0, 2], []),
    ],
)
def test_worked_case_of_the_four_flag_combinations(
    reuse: bool, commit: bool, reused: int, table_ids: list[int], copies: list[CopyOp]
) -> None:
    cache = make_cache(reuse=reuse, commit=commit)
    prompt = tokens(100, 49)
    first = cache.allocate_prompt(prompt)
    cache.check_integrity([first.table])
    assert first.table == BlockTable([0, 1], 49) and first.num_cached_tokens == 0
    cache.commit(first.table, prompt)
    cache.check_integrity([first.table])
    assert len(cache.tree) == (2 if commit else 1)
    second = cache.allocate_prompt(prompt)
    cache.check_integrity([first.table, second.table])
    assert second.num_cached_tokens == reused
    assert second.num_cached_blocks == 1
    assert second.table == BlockTable(table_ids, 49)
    assert second.copies == copies
    assert cache.allocator.ref_count(0) == 2 and cache.allocator.ref_count(1) == 1
    assert cache.stats.reused_tokens == reused
    assert cache.stats.new_blocks == 3 and cache.stats.copied_blocks == len(copies)


def test_copy_on_write_of_a_partly_shared_full_block() -> None:
    cache = make_cache(reuse=True)
    first = cache.allocate_prompt(tokens(0, 64))
    cache.commit(first.table, tokens(0, 64))
    cache.free(first.table)
    cache.check_integrity([])
    assert cache.allocator.cached_block_ids() == [1, 0]
    # Shares block 0 whole and the first 16 tokens of block 1, then diverges.
    second = cache.allocate_prompt(tokens(0, 48) + [999, 5])
    cache.check_integrity([second.table])
    assert second.table == BlockTable([0, 2], 50)
    assert (second.num_cached_blocks, second.num_cached_tokens) == (1, 48)
    assert second.copies == [CopyOp(1, 2)]
    # The copy source is cached again, not held: only the private copy is written.
    assert cache.allocator.cached_block_ids() == [1]
    without_reuse = cache.allocate_prompt(tokens(0, 48) + [999, 5], allow_partial_reuse=False)
    cache.check_integrity([second.table, without_reuse.table])
    assert without_reuse.table == BlockTable([0, 3], 50)
    assert (without_reuse.num_cached_tokens, without_reuse.copies) == (32, [])


def test_copy_source_is_not_evicted_by_its_own_allocation() -> None:
    cache = make_cache(num_blocks=5, tokens_per_block=16, reuse=True)
    first = cache.allocate_prompt(tokens(0, 32))
    cache.commit(first.table, tokens(0, 32))
    cache.free(first.table)
    other = cache.allocate_prompt(tokens(500, 17))
    cache.commit(other.table, tokens(500, 17))
    cache.free(other.table)
    cache.check_integrity([])
    assert other.table.block_ids == [] and cache.allocator.cached_block_ids() == [1, 0, 2]
    second = cache.allocate_prompt(tokens(0, 24) + tokens(900, 25))
    cache.check_integrity([second.table])
    # Fresh blocks: free 3 and 4, then the oldest cached block not held (2, not 1 or 0).
    assert second.table == BlockTable([0, 3, 4, 2], 49)
    assert second.copies == [CopyOp(1, 3)]
    assert cache.tree.key_of_block(2) is None
    assert cache.allocator.cached_block_ids() == [1]


def test_lru_eviction_drops_keys_and_later_lookups_miss() -> None:
    cache = make_cache(num_blocks=5, tokens_per_block=16)
    old = cache.allocate_prompt(tokens(0, 33))
    cache.commit(old.table, tokens(0, 33))
    cache.free(old.table)
    recent = cache.allocate_prompt(tokens(100, 17))
    cache.commit(recent.table, tokens(100, 17))
    assert recent.table.block_ids == [2, 3]
    cache.free(recent.table)
    cache.check_integrity([])
    # Tails are released first: old's block 1 is the least recently used, then 0, then 2.
    assert cache.allocator.cached_block_ids() == [1, 0, 2]
    taken = cache.allocate_prompt(tokens(200, 56))
    cache.check_integrity([taken.table])
    assert taken.table.block_ids == [3, 4, 1, 0]
    assert cache.allocator.cached_block_ids() == [2]
    assert cache.tree.match(tokens(0, 32)).num_matched_tokens == 0
    assert cache.tree.match(tokens(100, 16)).block_ids == [2]
    cache.free(taken.table)
    again = cache.allocate_prompt(tokens(100, 17))
    cache.check_integrity([again.table])
    assert (again.num_cached_tokens, again.table.block_ids) == (16, [2, 0])


def test_salt_scopes_reuse() -> None:
    cache = make_cache()
    prompt = tokens(0, 70)
    first = cache.allocate_prompt(prompt, salt=b"alice")
    cache.commit(first.table, prompt, salt=b"alice")
    bob = cache.allocate_prompt(prompt, salt=b"bob")
    alice = cache.allocate_prompt(prompt, salt=b"alice")
    cache.check_integrity([first.table, bob.table, alice.table])
    assert (bob.num_cached_tokens, bob.table.block_ids) == (0, [3, 4, 5])
    assert (alice.num_cached_tokens, alice.table.block_ids) == (64, [0, 1, 6])


def test_commit_is_idempotent_and_republishes_a_grown_partial_block() -> None:
    cache = make_cache(num_blocks=4, tokens_per_block=16, commit=True)
    allocation = cache.allocate_prompt(tokens(0, 20))
    cache.commit(allocation.table, tokens(0, 20))
    cache.commit(allocation.table, tokens(0, 20))
    cache.check_integrity([allocation.table])
    partial_key = cache.tree.key_of_block(1)
    assert len(cache.tree) == 2 and partial_key is not None
    cache.append_slots(allocation.table, 12)
    cache.commit(allocation.table, tokens(0, 32))
    cache.check_integrity([allocation.table])
    assert len(cache.tree) == 2 and cache.tree.key_of_block(1) not in (None, partial_key)
    with pytest.raises(ValueError):
        cache.commit(allocation.table, tokens(0, 33))


def test_expansion_at_full_prompt_shares_everything() -> None:
    cache = make_cache()
    allocation = cache.allocate_prompt(tokens(0, 64))
    beams, copies = cache.reorder_beams([allocation.table], [0] * 4)
    cache.check_integrity(beams)
    assert copies == []
    assert beams[0] is allocation.table
    assert [beam.block_ids for beam in beams] == [[0, 1]] * 4
    assert cache.allocator.ref_count(0) == cache.allocator.ref_count(1) == 4
    for beam in beams:
        cache.append_slots(beam)
        cache.check_integrity(beams)
    assert [beam.block_ids for beam in beams] == [[0, 1, 2], [0, 1, 3], [0, 1, 4], [0, 1, 5]]
    assert cache.num_blocks_in_use() == 6 == cache.blocks_needed(64, 65, 4)


def expand_prompt_67(cache: KVCacheManager) -> list[BlockTable]:
    allocation = cache.allocate_prompt(tokens(0, 67))
    beams, copies = cache.reorder_beams([allocation.table], [0] * 4)
    cache.check_integrity(beams)
    assert beams[0] is allocation.table
    assert copies == [CopyOp(2, 3), CopyOp(2, 4), CopyOp(2, 5)]
    return beams


def test_expansion_at_partial_prompt_copies_the_tail_per_extra_beam() -> None:
    cache = make_cache()
    beams = expand_prompt_67(cache)
    assert beams == [BlockTable([0, 1, tail], 67) for tail in (2, 3, 4, 5)]
    assert [cache.allocator.ref_count(block_id) for block_id in range(7)] == [4, 4, 1, 1, 1, 1, 0]
    assert cache.stats.copied_blocks == 3 and cache.stats.new_blocks == 6


def test_shrink_frees_dropped_private_blocks_and_keeps_shared_ones() -> None:
    cache = make_cache()
    beams = expand_prompt_67(cache)
    survivors, copies = cache.reorder_beams(beams, [1, 2])
    cache.check_integrity(survivors)
    assert copies == [] and survivors == [BlockTable([0, 1, 3], 67), BlockTable([0, 1, 4], 67)]
    assert beams[0].block_ids == [] and beams[3].block_ids == []
    assert [cache.allocator.ref_count(block_id) for block_id in range(6)] == [2, 2, 0, 1, 1, 0]
    assert cache.num_blocks_in_use() == 4


def test_reorder_reuses_freed_blocks_for_copies() -> None:
    cache = make_cache()
    beams = expand_prompt_67(cache)
    new_beams, copies = cache.reorder_beams(beams, [1, 1, 2, 1])
    cache.check_integrity(new_beams)
    assert new_beams[0] is beams[1] and new_beams[2] is beams[2]
    assert copies == [CopyOp(3, 2), CopyOp(3, 5)]
    assert [beam.block_ids for beam in new_beams] == [[0, 1, 3], [0, 1, 2], [0, 1, 4], [0, 1, 5]]


def test_expansion_is_all_or_nothing() -> None:
    cache = make_cache(num_blocks=5)
    allocation = cache.allocate_prompt(tokens(0, 67))
    before = snapshot(cache)
    with pytest.raises(OutOfBlocksError):
        cache.reorder_beams([allocation.table], [0] * 4)
    cache.check_integrity([allocation.table])
    assert snapshot(cache) == before and allocation.table == BlockTable([0, 1, 2], 67)
    beams, copies = cache.reorder_beams([allocation.table], [0] * 3)
    cache.check_integrity(beams)
    assert copies == [CopyOp(2, 3), CopyOp(2, 4)] and cache.num_free_blocks() == 0


def test_reorder_counts_only_blocks_that_dropping_really_releases() -> None:
    cache = make_cache(num_blocks=7)
    beams = expand_prompt_67(cache)
    assert cache.num_free_blocks() == 1
    # Dropping beam 3 releases block 5 only (0 and 1 are still shared): three copies find two.
    before = snapshot(cache)
    with pytest.raises(OutOfBlocksError):
        cache.reorder_beams(beams, [0, 0, 0, 0, 1, 2])
    cache.check_integrity(beams)
    assert snapshot(cache) == before and beams[3].block_ids == [0, 1, 5]
    new_beams, copies = cache.reorder_beams(beams, [0, 0, 1, 2])
    cache.check_integrity(new_beams)
    assert copies == [CopyOp(2, 5)]


def test_append_slots_is_all_or_nothing() -> None:
    cache = make_cache(num_blocks=4)
    allocation = cache.allocate_prompt(tokens(0, 32))
    before = snapshot(cache)
    with pytest.raises(OutOfBlocksError):
        cache.append_slots(allocation.table, 97)
    cache.check_integrity([allocation.table])
    assert snapshot(cache) == before and allocation.table == BlockTable([0], 32)
    cache.append_slots(allocation.table, 96)
    cache.check_integrity([allocation.table])
    assert allocation.table == BlockTable([0, 1, 2, 3], 128)


def test_allocate_prompt_is_all_or_nothing_and_does_not_count_held_cached_blocks() -> None:
    cache = make_cache(num_blocks=4, tokens_per_block=16)
    first = cache.allocate_prompt(tokens(0, 33))
    cache.commit(first.table, tokens(0, 33))
    cache.free(first.table)
    before = snapshot(cache)
    # 5 blocks: 2 shared from the cache, 3 fresh; only 2 are free once the shared ones are held.
    with pytest.raises(OutOfBlocksError):
        cache.allocate_prompt(tokens(0, 33) + tokens(900, 40))
    cache.check_integrity([])
    assert snapshot(cache) == before and cache.stats.new_blocks == 3


def test_append_into_shared_partial_block_is_refused() -> None:
    cache = make_cache()
    allocation = cache.allocate_prompt(tokens(0, 40))
    cache.allocator.incref(1)  # as if a bug shared the partial tail
    with pytest.raises(ValueError):
        cache.append_slots(allocation.table)
    with pytest.raises(AssertionError):
        cache.check_integrity([allocation.table])


def test_blocks_needed_formula() -> None:
    cache = make_cache()
    assert cache.blocks_needed(67, 100, 4) == 2 + 4 * (4 - 2)
    assert cache.blocks_needed(64, 65, 4) == 6
    assert cache.blocks_needed(64, 64, 4) == 2
    assert cache.blocks_needed(67, 100, 4, reused_blocks=2) == 8
    assert cache.blocks_needed(10, 20, 1) == 1


@pytest.mark.parametrize(
    ("prompt_len", "total_len", "beam_width", "seed"), [(67, 140, 4, 0), (64, 130, 3, 1)]
)
def test_simulated_request_never_exceeds_the_formula(
    prompt_len: int, total_len: int, beam_width: int, seed: int
) -> None:
    rng = random.Random(seed)
    cache = make_cache(num_blocks=64)
    bound = cache.blocks_needed(prompt_len, total_len, beam_width)
    allocation = cache.allocate_prompt(tokens(0, prompt_len))
    beams, _ = cache.reorder_beams([allocation.table], [0] * beam_width)
    peak = num_distinct_blocks(beams)
    for _ in range(prompt_len, total_len):
        for beam in beams:
            cache.append_slots(beam)
        cache.check_integrity(beams)
        peak = max(peak, num_distinct_blocks(beams), cache.num_blocks_in_use())
        parents = [rng.randrange(len(beams)) for _ in range(beam_width)]
        beams, _ = cache.reorder_beams(beams, parents)
        cache.check_integrity(beams)
        peak = max(peak, cache.num_blocks_in_use())
    assert peak <= bound
    assert cache.stats.peak_blocks_in_use <= bound
    # Beams that never fork reach the bound exactly: no slack hides a miscount.
    identity = make_cache(num_blocks=64)
    allocation = identity.allocate_prompt(tokens(0, prompt_len))
    beams, _ = identity.reorder_beams([allocation.table], [0] * beam_width)
    for beam in beams:
        identity.append_slots(beam, total_len - prompt_len)
    identity.check_integrity(beams)
    assert identity.stats.peak_blocks_in_use == bound == num_distinct_blocks(beams)
    for beam in beams:
        identity.free(beam)
        identity.check_integrity([beam for beam in beams if beam.block_ids])
    assert identity.num_blocks_in_use() == 0 and identity.num_free_blocks() == 64
