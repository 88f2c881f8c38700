"""KV groups (engine/kv_groups.py): one cache per group of layers of one attention kind, all over
one shared page-id space, out-of-window blocks released.

Window 8, blocks 16 (the smallest block size): query i sees key j when i - 8 < j <= i, so block b
(positions [16b, 16b + 16)) is dead for every query at or after 16b + 15 + 8.
"""

from __future__ import annotations

import pytest

from engine.config import CacheConfig
from engine.kv_cache import HOLE, KVCacheManager, OutOfBlocksError
from engine.kv_group_tables import KVGroup, layers_per_group, make_kv_groups
from engine.kv_groups import KVGroups
from engine.prefix_tree import ROOT_KEY, block_key

T = 16
WINDOW = 8


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def sliding_cache(num_blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(CacheConfig(T, num_blocks), sliding_window=WINDOW)


def test_groups_follow_the_layer_windows() -> None:
    # 1 full layer, 2 sliding: groups of 1 layer (every page the same size).
    assert make_kv_groups((WINDOW, None, WINDOW)) == (
        KVGroup(None, (1,)),
        KVGroup(WINDOW, (0,)),
        KVGroup(WINDOW, (2,)),
    )
    # One kind of layers: one group of every layer, as before groups existed.
    assert make_kv_groups((None, None)) == (KVGroup(None, (0, 1)),)
    assert make_kv_groups((WINDOW, WINDOW)) == (KVGroup(WINDOW, (0, 1)),)
    assert make_kv_groups((32, None, WINDOW)) == (
        KVGroup(None, (1,)),
        KVGroup(WINDOW, (2,)),
        KVGroup(32, (0,)),
    )
    # Not window-aware: one full group over every layer, the all-full layout.
    assert make_kv_groups((WINDOW, None, WINDOW), is_window_aware=False) == (KVGroup(None, (0, 1, 2)),)


def gemma3_windows(num_layers: int) -> tuple[int | None, ...]:
    """Gemma 3's pattern: every sixth layer full attention, the others a window of 512."""
    return tuple(None if index % 6 == 5 else 512 for index in range(num_layers))


def test_groups_have_the_same_size_and_waste_little() -> None:
    # Gemma 3 270M: 3 full + 15 sliding -> 1 full group and 5 window groups of 3 layers.
    groups = make_kv_groups(gemma3_windows(18))
    assert [(group.window, group.layer_indices) for group in groups] == [
        (None, (5, 11, 17)),
        (512, (0, 1, 2)),
        (512, (3, 4, 6)),
        (512, (7, 8, 9)),
        (512, (10, 12, 13)),
        (512, (14, 15, 16)),
    ]
    # Gemma 3 1B (4 + 22): the gcd 2 wastes nothing, 13 groups (the smallest kind's 4: 7 groups).
    assert layers_per_group([4, 22]) == 2 and len(make_kv_groups(gemma3_windows(26))) == 13
    # Gemma 3 4B (5 + 29): the gcd 1 would make 34 groups; 5 makes 7, the last window group holding
    # 4 layers in its 5 slots.
    groups = make_kv_groups(gemma3_windows(34))
    assert layers_per_group([5, 29]) == 5
    assert [len(group.layer_indices) for group in groups] == [5, 5, 5, 5, 5, 5, 4]
    assert sorted(layer for group in groups for layer in group.layer_indices) == list(range(34))


def test_the_window_boundary_is_transformers_mask() -> None:
    cache = sliding_cache()
    # Query 22 still sees key 15 (22 - 8 < 15): block 0 lives; query 23 does not.
    assert cache.num_out_of_window_blocks(22) == 0
    assert cache.num_out_of_window_blocks(23) == 1
    assert cache.num_out_of_window_blocks(39) == 2
    assert KVCacheManager(CacheConfig(T, 8)).num_out_of_window_blocks(1000) == 0  # full attention


def test_release_leaves_leading_holes_and_beams_keep_them() -> None:
    cache = sliding_cache()
    table = cache.allocate_prompt(tokens(0, 40)).table
    assert table.block_ids == [0, 1, 2]
    assert cache.release_out_of_window(table, 40) == 2  # the first decode query is at 40
    assert table.block_ids == [HOLE, HOLE, 2] and cache.num_blocks_in_use() == 1
    cache.check_integrity([table])
    beams, copies = cache.reorder_beams([table], [0, 0, 0])
    # The partial tail (8 tokens) is copied per beam; the holes stay holes in every beam.
    assert [beam.block_ids for beam in beams] == [[HOLE, HOLE, 2], [HOLE, HOLE, 0], [HOLE, HOLE, 1]]
    assert [(copy.src_block, copy.dst_block) for copy in copies] == [(2, 0), (2, 1)]
    cache.check_integrity(beams)
    for beam in beams:
        cache.append_slots(beam, 9)  # 49 tokens: the query at 48 still needs block 2 (keys 41..48)
        assert cache.release_out_of_window(beam, 48) == 0
    assert [beam.block_ids for beam in beams] == [[HOLE, HOLE, 2, 3], [HOLE, HOLE, 0, 4], [HOLE, HOLE, 1, 5]]
    cache.check_integrity(beams)
    for beam in beams:
        cache.free(beam)
    cache.check_integrity([])
    assert cache.num_blocks_in_use() == 0


def test_integrity_refuses_a_hole_inside_the_window() -> None:
    cache = sliding_cache()
    table = cache.allocate_prompt(tokens(0, 20)).table
    table.block_ids[0] = HOLE  # the query at 19 still sees keys 12..15 of block 0
    cache.allocator.decref(0)
    with pytest.raises(AssertionError, match="hole inside the window"):
        cache.check_integrity([table])
    full = KVCacheManager(CacheConfig(T, 8))
    full_table = full.allocate_prompt(tokens(0, 40)).table
    assert full.release_out_of_window(full_table, 40) == 0 and full_table.block_ids == [0, 1, 2]


def test_commit_skips_holes_and_keeps_the_hash_chain() -> None:
    cache = sliding_cache()
    prompt = tokens(0, 48)
    table = cache.allocate_prompt(prompt).table
    cache.commit(table, prompt[:32])  # blocks 0 and 1 published before they leave the window
    cache.release_out_of_window(table, 48)
    assert table.block_ids == [HOLE, HOLE, 2]
    cache.commit(table, prompt)
    key = ROOT_KEY
    for index in range(3):
        key = block_key(key, prompt[index * T : (index + 1) * T])
    node = cache.tree.node(key)
    assert node is not None and node.block_id == 2  # the key of block 2 names the whole prefix
    assert cache.allocator.cached_block_ids() == [0, 1]  # released, published: reusable
    cache.free(table)
    cache.check_integrity([])


def test_group_bounds_and_all_or_nothing_growth() -> None:
    groups = (KVGroup(None, (1,)), KVGroup(WINDOW, (0, 2)))
    cache = KVGroups(CacheConfig(T, 12), groups)
    # Prompt 40, total 52, 3 beams. Full: 2 shared + 3 * (4 - 2). Sliding: the prompt's 3 blocks
    # while prefilling, then 3 beams * min(4, ceil(8/16) + 1) = 6.
    assert cache.blocks_needed(40, 52, 3) == (8, 6)
    assert cache.blocks_needed(40, 52, 3, is_decoding=True) == (8, 6)
    assert cache.blocks_needed(100, 101, 1) == (7, 7)
    assert cache.blocks_needed(100, 101, 1, is_decoding=True) == (7, 2)
    # In chunks of at most 20: the first query's window and the chunk, ceil((8 + 20)/16) + 1.
    assert cache.blocks_needed(100, 101, 1, chunk_tokens=20) == (7, 3)
    assert cache.blocks_needed(100, 101, 4, chunk_tokens=20) == (7 + 3, 8)  # 4 beams x 2 blocks
    assert cache.blocks_needed(20, 21, 1, chunk_tokens=64) == (2, 2)  # never past the prompt's
    assert cache.blocks_needed(100, 101, 1, chunk_tokens=0) == (7, 2)  # a pulled prompt
    # One pool of 12 pages: the needs of all groups are summed against it.
    assert cache.num_blocks() == 12 and cache.fits((8, 4)) and not cache.fits((8, 5))
    allocation = cache.allocate_prompt(tokens(0, 40))
    table = allocation.table
    # One page-id space: the sliding group's pages are others than the full group's.
    assert table.group_block_ids() == ([0, 1, 2], [3, 4, 5])
    cache.release_out_of_window(table, 40)
    assert table.group_block_ids() == ([0, 1, 2], [HOLE, HOLE, 5])
    beams, _ = cache.reorder_beams([table], [0, 0, 0])
    # The released pages 3 and 4 serve the full group's beam copies.
    assert [beam.group_block_ids() for beam in beams] == [
        ([0, 1, 2], [HOLE, HOLE, 5]),
        ([0, 1, 3], [HOLE, HOLE, 6]),
        ([0, 1, 4], [HOLE, HOLE, 7]),
    ]
    assert cache.num_free_blocks() == 12 - 8 and cache.num_group_blocks_in_use() == (5, 3)
    for beam in beams[:2]:
        cache.append_slots(beam, 9)
    # The third beam needs a new block in each group: the shared pool has none left.
    before = [beam.group_block_ids() for beam in beams]
    with pytest.raises(OutOfBlocksError):
        cache.append_slots(beams[2], 9)
    assert [beam.group_block_ids() for beam in beams] == before and beams[2].num_tokens == 40
    cache.check_integrity(beams)
    for beam in beams:
        cache.free(beam)
    cache.check_integrity([])
    assert cache.num_group_blocks_in_use() == (0, 0)


def test_integrity_refuses_a_page_in_two_groups() -> None:
    cache = KVGroups(CacheConfig(T, 8), (KVGroup(None, (1,)), KVGroup(WINDOW, (0, 2))))
    table = cache.allocate_prompt(tokens(0, 32)).table
    assert table.group_block_ids() == ([0, 1], [2, 3])
    cache.check_integrity([table])
    # The sliding table names the full group's page 1 instead of its own 3.
    cache.allocator.incref(1)
    cache.allocator.decref(3)
    table.tables[1].block_ids[1] = 1
    with pytest.raises(AssertionError, match="two KV groups"):
        cache.check_integrity([table])


def test_eviction_reaches_the_tree_of_the_group_that_published_the_page() -> None:
    """A 4-page pool: a 32-token prompt's pages are published in both groups, then released
    (cached). A prompt of other tokens takes all 4 pages: the LRU evicts the full group's pages
    from the full tree and the sliding group's from the sliding tree."""
    cache = KVGroups(CacheConfig(T, 4), (KVGroup(None, (1,)), KVGroup(WINDOW, (0,))))
    prompt = tokens(0, 33)
    first = cache.allocate_prompt(prompt[:32])
    cache.commit(first.table, prompt[:32])
    cache.free(first.table)
    full_tree, sliding_tree = (manager.tree for manager in cache.managers)
    assert sorted(full_tree.block_ids()) == [0, 1] and sorted(sliding_tree.block_ids()) == [2, 3]
    cache.check_integrity([])
    other = cache.allocate_prompt(tokens(100, 32))
    assert len(full_tree) == len(sliding_tree) == 0
    cache.check_integrity([other.table])
    cache.free(other.table)


def test_pages_a_prompt_reuses_are_pinned_before_any_group_allocates() -> None:
    """An 8-page pool holding, cached, a 32-token prompt A's pages (2 per group) and, more
    recently, another prompt's. A's 49-token continuation reuses A's 2 full-group pages and the
    sliding group's block 1 (the window of query 32) and needs 4 fresh pages: the full group,
    allocating first, must evict the cached pages around the sliding group's reused one (the
    oldest), not it. A continuation needing more than the pool's unpinned pages is refused and the
    pool is left as it was."""
    groups = (KVGroup(None, (1,)), KVGroup(WINDOW, (0,)))
    cache = KVGroups(CacheConfig(T, 8), groups)
    prompt = tokens(0, 81)
    for start in (0, 100):
        other = prompt[:32] if start == 0 else tokens(start, 32)
        allocation = cache.allocate_prompt(other)
        cache.commit(allocation.table, other)
        cache.free(allocation.table)
    assert cache.allocator.cached_block_ids() == [1, 0, 3, 2, 5, 4, 7, 6]
    cached = cache.allocator.cached_block_ids()
    with pytest.raises(OutOfBlocksError, match="8 new blocks, 5 available"):
        cache.allocate_prompt(prompt)  # 6 blocks: 4 fresh in each group
    assert cache.allocator.cached_block_ids() == cached
    cache.check_integrity([])
    allocation = cache.allocate_prompt(prompt[:49])
    assert allocation.num_cached_tokens == 32
    assert allocation.table.group_block_ids() == ([0, 1, 2, 5], [HOLE, 3, 4, 7])
    cache.check_integrity([allocation.table])
    cache.free(allocation.table)
    cache.check_integrity([])


def test_one_full_group_reports_the_same_figure_twice() -> None:
    cache = KVGroups(CacheConfig(T, 8), (KVGroup(None, (0, 1)),))
    prompt = tokens(0, 40)
    first = cache.allocate_prompt(prompt)
    cache.commit(first.table, prompt)
    second = cache.allocate_prompt(prompt[:33] + [99])
    assert second.num_cached_tokens == 32
    assert second.full_attention_reusable_tokens == second.window_reusable_tokens == 32
    cache.free(first.table)
    cache.free(second.table)
    cache.check_integrity([])


def test_a_chunked_prompt_takes_its_sliding_blocks_chunk_by_chunk() -> None:
    groups = (KVGroup(None, (1,)), KVGroup(WINDOW, (0, 2)))
    cache = KVGroups(CacheConfig(T, 13), groups)
    prompt = tokens(0, 70)
    first = cache.allocate_prompt(prompt)
    assert first.table.group_block_ids() == ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9])
    cache.commit(first.table, prompt)
    cache.free(first.table)  # the partial last blocks 4 and 9 are free, the others cached
    # 40 tokens shared, then 30 others: reuse stops at 32 (whole blocks). The full group takes the
    # whole prompt; the sliding group looks up only its block 1 (page 6, the window of query 32)
    # and takes nothing past the reused prefix yet.
    allocation = cache.allocate_prompt(prompt[:40] + tokens(500, 30), is_chunked=True)
    table = allocation.table
    assert allocation.num_cached_tokens == 32 and table.num_tokens == table.prompt_len == 70
    assert table.group_block_ids() == ([0, 1, 4, 9, 10], [HOLE, 6])
    cache.check_integrity([table])
    with pytest.raises(ValueError, match="chunk end 71"):
        cache.extend_for_chunk(table, 71)
    # Chunk [32, 52): blocks 2 and 3 more; then query 52 no longer sees block 1.
    assert cache.extend_for_chunk(table, 52) == 2
    assert table.group_block_ids() == ([0, 1, 4, 9, 10], [HOLE, 6, 11, 12])
    cache.check_integrity([table])
    assert cache.release_out_of_window(table, 52) == 1
    assert table.group_block_ids()[1] == [HOLE, HOLE, 11, 12]
    # Another prompt takes the pool's last 6 pages (evicting the cached ones, in both groups):
    # the next chunk must wait, and a failed extension changes nothing in any group.
    other = cache.allocate_prompt(tokens(900, 36), is_chunked=True)
    assert other.table.group_block_ids()[1] == []
    assert cache.extend_for_chunk(other.table, 36) == 3
    assert cache.num_free_blocks() == 0
    before = table.group_block_ids()
    with pytest.raises(OutOfBlocksError):
        cache.extend_for_chunk(table, 70)
    assert table.group_block_ids() == before and table.prompt_len == 70
    cache.check_integrity([table, other.table])
    cache.free(other.table)
    assert cache.extend_for_chunk(table, 70) == 1
    # Whole in every group: a plain table again, as a decode step expects.
    assert table.prompt_len == 0 and table.num_tokens == 70 and len(table.group_block_ids()[1]) == 5
    cache.check_integrity([table])
    cache.free(table)
    cache.check_integrity([])
