"""KVPool layout: one contiguous page per block, adjacent blocks adjacent; whole-page copies."""

from __future__ import annotations

import torch

from engine.config import CacheConfig
from engine.kv_cache import CopyOp
from engine.kv_pool import KEY, VALUE, KVPool
from engine.models.loader import tiny_model_config


def make_pool(dtype: torch.dtype = torch.float32) -> KVPool:
    return KVPool(tiny_model_config(), CacheConfig(tokens_per_block=16, num_blocks=6), dtype, "cpu")


def test_page_is_one_block_across_all_layers() -> None:
    pool = make_pool()
    config = tiny_model_config()
    expected = config.num_hidden_layers * 2 * 16 * config.num_key_value_heads * config.head_dim * 4
    assert pool.page_bytes == expected
    assert pool.data.is_contiguous()
    assert pool.data.shape == (
        6,
        config.num_hidden_layers,
        2,
        16,
        config.num_key_value_heads,
        config.head_dim,
    )
    region = pool.region()
    assert (region.address, region.page_bytes, region.num_pages, region.device) == (
        pool.data.data_ptr(),
        expected,
        6,
        "cpu",
    )
    for block in range(6):
        assert pool.data[block].data_ptr() == region.address + block * region.page_bytes


def test_page_bytes_follow_dtype() -> None:
    assert make_pool(torch.bfloat16).page_bytes * 4 == make_pool(torch.float64).page_bytes


def test_layer_view_writes_through_to_the_pool() -> None:
    pool = make_pool()
    pool.layer_view(1)[3, VALUE, 5] = 7.0
    assert torch.all(pool.data[3, 1, VALUE, 5] == 7.0)
    assert int(torch.count_nonzero(pool.data)) == pool.data[3, 1, VALUE, 5].numel()


def test_copy_blocks_copies_whole_pages_and_reads_sources_first() -> None:
    pool = make_pool()
    for block in range(pool.num_blocks):
        pool.data[block] = float(block)
    pool.layer_view(0)[2, KEY, 0] = -1.0
    before = pool.data.clone()
    # 2 -> 4 and 4 -> 5 in one call: block 5 gets block 4's old content, not block 2's.
    pool.copy_blocks([CopyOp(src_block=2, dst_block=4), CopyOp(src_block=4, dst_block=5)])
    assert torch.equal(pool.data[4], before[2])
    assert torch.equal(pool.data[5], before[4])
    for block in (0, 1, 2, 3):
        assert torch.equal(pool.data[block], before[block])
    pool.copy_blocks([])


def test_copy_blocks_without_a_chain_copies_each_page_once() -> None:
    """Copies whose destinations are no copy's source (a beam step's copy-on-write): each
    destination gets its source's page, one source may feed several, every other page stays."""
    pool = make_pool()
    for block in range(pool.num_blocks):
        pool.data[block] = float(block)
    pool.layer_view(1)[1, VALUE, 2] = -3.0
    before = pool.data.clone()
    pool.copy_blocks([CopyOp(src_block=1, dst_block=3), CopyOp(src_block=1, dst_block=5), CopyOp(2, 4)])
    assert torch.equal(pool.data[3], before[1]) and torch.equal(pool.data[5], before[1])
    assert torch.equal(pool.data[4], before[2])
    for block in (0, 1, 2):
        assert torch.equal(pool.data[block], before[block])


def test_pool_bytes_bound_lowers_the_block_count() -> None:
    config = tiny_model_config()
    page_bytes = KVPool.page_bytes_for(config, 16, torch.float64)
    assert page_bytes == make_pool(torch.float64).page_bytes  # known before any pool exists
    bounded = CacheConfig(
        tokens_per_block=16, num_blocks=2048, max_pool_bytes=10 * page_bytes + page_bytes // 2
    )
    assert bounded.fitted_to(page_bytes).num_blocks == 10
    assert CacheConfig(num_blocks=4, max_pool_bytes=10 * page_bytes).fitted_to(page_bytes).num_blocks == 4
    assert CacheConfig(max_pool_bytes=1).fitted_to(page_bytes).num_blocks == 1
    assert CacheConfig(num_blocks=7).fitted_to(page_bytes).num_blocks == 7  # no bound: as asked


def test_engine_settles_its_pool_size_from_the_bound() -> None:
    from engine import EngineConfig, LLMEngine

    page_bytes = KVPool.page_bytes_for(tiny_model_config(), 32, torch.float32)
    cache = CacheConfig(tokens_per_block=32, num_blocks=2048, max_pool_bytes=24 * page_bytes)
    engine = LLMEngine(EngineConfig(model="tiny", cache=cache))
    assert engine.config.cache.num_blocks == engine.kv_pool.num_blocks == 24
    assert engine.kv_region().num_pages == 24
    engine.check_integrity()
