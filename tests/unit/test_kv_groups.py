"""KV groups (engine/kv_groups.py): one cache per attention kind, out-of-window blocks released.

Window 8, blocks 16 (the smallest block size): query i sees key j when i - 8 < j <= i, so block b
(positions [16b, 16b + 16)) is dead for every query at or after 16b + 15 + 8.
"""

from __future__ import annotations

import pytest

from engine.config import CacheConfig
from engine.kv_cache import HOLE, KVCacheManager, OutOfBlocksError
from engine.kv_group_sizing import group_cache_configs
from engine.kv_groups import KVGroup, KVGroups, make_kv_groups
from engine.prefix_tree import ROOT_KEY, block_key

T = 16
WINDOW = 8


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def sliding_cache(num_blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(CacheConfig(T, num_blocks), sliding_window=WINDOW)


def test_groups_follow_the_layer_windows() -> None:
    assert make_kv_groups((WINDOW, None, WINDOW)) == (KVGroup(None, (1,)), KVGroup(WINDOW, (0, 2)))
    assert make_kv_groups((None, None)) == (KVGroup(None, (0, 1)),)
    assert make_kv_groups((WINDOW, WINDOW)) == (KVGroup(WINDOW, (0, 1)),)
    assert make_kv_groups((32, None, WINDOW)) == (
        KVGroup(None, (1,)),
        KVGroup(WINDOW, (2,)),
        KVGroup(32, (0,)),
    )
    # Not window-aware: one full group over every layer, the all-full layout.
    assert make_kv_groups((WINDOW, None, WINDOW), is_window_aware=False) == (KVGroup(None, (0, 1, 2)),)


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
    cache = KVGroups([CacheConfig(T, 16), CacheConfig(T, 5)], groups)
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
    allocation = cache.allocate_prompt(tokens(0, 40))
    table = allocation.table
    assert table.group_block_ids() == ([0, 1, 2], [0, 1, 2])
    cache.release_out_of_window(table, 40)
    assert table.group_block_ids() == ([0, 1, 2], [HOLE, HOLE, 2])
    beams, _ = cache.reorder_beams([table], [0, 0, 0])
    assert cache.num_free_group_blocks() == (16 - 5, 5 - 3)
    for beam in beams[:2]:
        cache.append_slots(beam, 9)
    # The third beam needs a new block in each group: the sliding group has none left.
    before = [beam.group_block_ids() for beam in beams]
    with pytest.raises(OutOfBlocksError):
        cache.append_slots(beams[2], 9)
    assert [beam.group_block_ids() for beam in beams] == before and beams[2].num_tokens == 40
    cache.check_integrity(beams)
    for beam in beams:
        cache.free(beam)
    cache.check_integrity([])
    assert cache.num_group_blocks_in_use() == (0, 0)


def test_memory_budget_splits_by_a_full_length_request() -> None:
    groups = (KVGroup(None, (1,)), KVGroup(WINDOW, (0, 2)))
    cache = CacheConfig(T, 2048, max_pool_bytes=1_000_000, is_sized_by_memory=True)
    # max_len 512: 32 blocks. A prompt is allocated whole while it is prefilled, so the sliding
    # group needs 32 blocks of 2000 bytes too: the budget splits 1:2, as many blocks each.
    full, sliding = group_cache_configs(cache, groups, [1000, 2000], 512)
    assert full.num_blocks == 1_000_000 * 32_000 // 96_000 // 1000 == 333
    assert sliding.num_blocks == 1_000_000 * 64_000 // 96_000 // 2000 == 333
    # Prompts in chunks of 16: the sliding group holds at most ceil((8 + 16)/16) + 1 = 3 blocks,
    # 32 blocks of 1000 against 3 of 2000: the full group gets 2.5x the blocks it had.
    full, sliding = group_cache_configs(cache, groups, [1000, 2000], 512, chunk_tokens=16)
    assert full.num_blocks == 1_000_000 * 32_000 // 38_000 // 1000 == 842
    assert sliding.num_blocks == 1_000_000 * 6_000 // 38_000 // 2000 == 78
    # A prompt that arrives whole (chunk 0): the window alone, ceil(8/16) + 1 = 2 blocks.
    full, sliding = group_cache_configs(cache, groups, [1000, 2000], 512, chunk_tokens=0)
    assert full.num_blocks == 1_000_000 * 32_000 // 36_000 // 1000 == 888
    assert sliding.num_blocks == 1_000_000 * 4_000 // 36_000 // 2000 == 55
    # 4 beams: each decodes with its own 2 window blocks (8 > the chunk's 3); the full group's
    # 512 tokens are 32 whole blocks, shared.
    full, sliding = group_cache_configs(cache, groups, [1000, 2000], 512, chunk_tokens=16, beam_width=4)
    assert full.num_blocks == 1_000_000 * 32_000 // 48_000 // 1000 == 666
    assert sliding.num_blocks == 1_000_000 * 16_000 // 48_000 // 2000 == 166
    by_count = group_cache_configs(CacheConfig(T, 64), groups, [1000, 2000], 512)
    assert [config.num_blocks for config in by_count] == [64, 64]
    (one,) = group_cache_configs(cache, groups[:1], [1000], 512)
    assert one.num_blocks == 1000


def test_one_full_group_reports_the_same_figure_twice() -> None:
    cache = KVGroups([CacheConfig(T, 8)], (KVGroup(None, (0, 1)),))
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
    cache = KVGroups([CacheConfig(T, 16), CacheConfig(T, 5)], groups)
    prompt = tokens(0, 70)
    first = cache.allocate_prompt(prompt)
    cache.commit(first.table, prompt)
    cache.free(first.table)
    # 40 tokens shared, then 30 others: reuse stops at 32 (whole blocks). The full group takes the
    # whole prompt; the sliding group looks up only block 1 (the window of query 32) and takes
    # nothing past the reused prefix yet.
    allocation = cache.allocate_prompt(prompt[:40] + tokens(500, 30), is_chunked=True)
    table = allocation.table
    assert allocation.num_cached_tokens == 32 and table.num_tokens == table.prompt_len == 70
    assert table.group_block_ids() == ([0, 1, 4, 5, 6], [HOLE, 1])
    cache.check_integrity([table])
    with pytest.raises(ValueError, match="chunk end 71"):
        cache.extend_for_chunk(table, 71)
    # Chunk [32, 52): blocks 2 and 3 more; then query 52 no longer sees block 1.
    assert cache.extend_for_chunk(table, 52) == 2
    assert table.group_block_ids() == ([0, 1, 4, 5, 6], [HOLE, 1, 4, 3])
    cache.check_integrity([table])
    assert cache.release_out_of_window(table, 52) == 1
    assert table.group_block_ids()[1] == [HOLE, HOLE, 4, 3]
    # Another prompt takes the sliding group's last 3 blocks: the next chunk must wait, and a
    # failed extension changes nothing in any group.
    other = cache.allocate_prompt(tokens(900, 36), is_chunked=True)
    assert other.table.group_block_ids()[1] == []
    assert cache.extend_for_chunk(other.table, 36) == 3
    assert cache.num_free_group_blocks()[1] == 0
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
