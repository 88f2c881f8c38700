"""Prefix-aware routing at the coordinator: the prompt keys it computes are the workers' own tree
keys, its per-worker index is a bounded LRU whose chains stop at the first miss, and `rank`
prefers the worker holding most of the prompt within the load slack, else the least loaded.
"""

from __future__ import annotations

import pytest

from coordinator.prefix_routing import Candidate, PrefixIndex, prompt_keys, rank
from coordinator.worker_pool import WorkerPool
from engine.config import CacheConfig
from engine.kv_cache import KVCacheManager

BLOCK = 16


def prompt_of(length: int, offset: int) -> list[int]:
    return [(offset + 7 * index) % 250 for index in range(length)]


def test_recorded_and_lookup_blocks_follow_the_workers_lookup_of_prompt_minus_one() -> None:
    # 32 tokens, block 16: the tree holds 2 full blocks, a lookup of prompt[:-1] can match only 1.
    keys = prompt_keys(prompt_of(32, 1), b"", BLOCK)
    assert (len(keys.recorded), len(keys.lookup)) == (2, 1)
    keys = prompt_keys(prompt_of(33, 1), b"", BLOCK)
    assert (len(keys.recorded), len(keys.lookup)) == (2, 2)
    assert prompt_keys([5], b"", BLOCK).recorded == ()
    assert prompt_keys(prompt_of(33, 1), b"tenant", BLOCK).recorded[0] != keys.recorded[0]
    with pytest.raises(ValueError, match="tokens_per_block"):
        prompt_keys([1, 2], b"", 0)


@pytest.mark.parametrize("salt", [b"", b"tenant-a"])
def test_the_index_predicts_what_a_worker_tree_reuses(salt: bytes) -> None:
    """Same keys as engine/prefix_tree.py: after one worker committed prompt A, the index scores
    prompt B exactly as many blocks as the worker's own lookup then reuses."""
    cache = KVCacheManager(CacheConfig(tokens_per_block=BLOCK, num_blocks=64))
    first = prompt_of(92, 3)  # 5 full blocks and 12 tokens
    allocation = cache.allocate_prompt(first, salt)
    cache.commit(allocation.table, first, salt)
    cache.free(allocation.table)
    index = PrefixIndex()
    index.insert(prompt_keys(first, salt, BLOCK).recorded)
    for shared in (0, 12, 16, 36, 64, 80, 81, 92):
        second = first[:shared] + prompt_of(120 - shared, 100)
        predicted = index.match(prompt_keys(second, salt, BLOCK).lookup)
        lookup = cache.allocate_prompt(second, salt, allow_partial_reuse=False)  # as reserve_prompt
        assert lookup.num_cached_tokens == predicted * BLOCK, shared
        cache.free(lookup.table)
        cache.check_integrity([])
    index.check_integrity()


def test_the_index_is_a_bounded_lru_whose_chains_stop_at_the_first_miss() -> None:
    index = PrefixIndex(capacity=4)
    old, new = prompt_keys(prompt_of(52, 1), b"", BLOCK), prompt_keys(prompt_of(36, 50), b"", BLOCK)
    index.insert(old.recorded)  # 3 keys
    assert index.match(old.lookup) == 3
    index.insert(new.recorded)  # 2 more: the least recently sent of the old ones goes
    assert len(index) == 4
    assert index.match(old.lookup) == 0  # its first block went, so nothing after it matches
    assert index.match(new.lookup) == 2
    index.check_integrity()
    index.resize(1)
    assert len(index) == 1 and index.match(new.lookup) == 0
    index.clear()
    assert len(index) == 0
    index.check_integrity()
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(capacity=0)


def candidate(index: int, load: int, matched: int, in_flight: int = 0) -> Candidate:
    return Candidate(index=index, load=load, num_in_flight=in_flight, num_matched_blocks=matched)


def test_rank_prefers_the_longest_prefix_within_the_slack() -> None:
    assert rank([candidate(0, 0, 0), candidate(1, 0, 3)], slack=2).index == 1
    assert rank([candidate(0, 0, 2), candidate(1, 2, 3)], slack=2).index == 1  # 2 above: still in
    assert rank([candidate(0, 1, 5), candidate(1, 0, 4), candidate(2, 3, 9)], slack=1).index == 0


def test_rank_goes_by_load_past_the_slack_and_without_a_match() -> None:
    assert rank([candidate(0, 0, 0), candidate(1, 3, 8)], slack=2).index == 0  # 3 above: load wins
    assert rank([candidate(0, 1, 0), candidate(1, 0, 0)], slack=2).index == 1
    assert rank([candidate(0, 0, 1), candidate(1, 1, 8)], slack=0).index == 0  # slack 0: load only
    # Ties: the longer prefix, then load, then requests this coordinator has in flight, then order.
    assert rank([candidate(0, 2, 3), candidate(1, 1, 3)], slack=2).index == 1
    assert rank([candidate(0, 1, 0, in_flight=1), candidate(1, 1, 0, in_flight=0)], slack=2).index == 1
    assert rank([candidate(0, 0, 0), candidate(1, 0, 0)], slack=2).index == 0


def test_the_pool_routes_by_what_it_remembers_and_forgets_an_unhealthy_worker() -> None:
    pool = WorkerPool("generation", ["127.0.0.1:1", "127.0.0.1:2"], lambda channel: None, affinity_slack=1)
    try:
        first, second = pool.workers
        for worker in pool.workers:
            worker.is_healthy = True
        shared = prompt_keys(prompt_of(70, 1), b"", BLOCK)
        assert pool.pick(keys=shared) is first  # nothing known: the least loaded, in order
        pool.finish(first)
        pool.remember(second, shared)
        chosen = pool.pick(keys=shared)
        assert chosen is second  # 4 blocks matched there
        other = pool.pick(keys=prompt_keys(prompt_of(70, 90), b"", BLOCK))
        assert other is first  # unrelated: by load (second has 1 in flight)
        assert pool.pick(keys=shared) is second  # 1 vs 1: the prefix
        assert pool.pick(keys=shared) is second  # 2 vs 1: within the slack of 1
        assert pool.pick(keys=shared) is first  # 3 vs 1: past the slack, load wins
        for worker in (second, first, second, second, first):
            pool.finish(worker)
        pool.check_integrity()
        pool.mark_unhealthy(second, "probe failed")
        assert len(second.prefix_index) == 0
        second.is_healthy = True
        assert pool.pick(keys=shared) is first  # forgotten: it may have restarted empty
        pool.finish(first)
        pool.check_integrity()
    finally:
        pool.close()
