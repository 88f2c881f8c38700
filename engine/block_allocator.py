"""Logical KV blocks: integer ids with reference counts, a free heap and an LRU of cached blocks.

Plain Python over integers; the physical pool (`kv_pool.py`) never sees this bookkeeping.

Every block is in exactly one of three states:
- free:   reference count 0, holds nothing anyone can find; on the free heap.
- cached: reference count 0, but its content is published in the prefix tree, so a later
          request may share it; kept in least-recently-released order and evicted oldest first
          when the free heap runs dry. Eviction drops its key from the tree (`on_evict`).
- in use: reference count >= 1. Never evicted, never handed out again.

Several KV groups may share one allocator (one page-id space, docs/cache.md): each registers as an
owner (`add_owner`) with its own eviction callback. A block belongs to the owner that allocated
it until it is handed out again, so a cached block's eviction reaches the tree that published it
and the blocks in use can be counted per owner.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable


class OutOfBlocksError(RuntimeError):
    """Not enough free or evictable blocks; raised with the allocator exactly as before the call."""


class PoolTooSmallError(OutOfBlocksError):
    """A request's block bound exceeds the whole pool: it can never fit, so waiting cannot help."""


def _ignore_eviction(block_id: int) -> None:
    del block_id


class BlockAllocator:
    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] = _ignore_eviction) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # Owner o's eviction callback; owner 0 is the one constructed with the allocator.
        self._evict_callbacks = [on_evict]
        self._owners = [0] * num_blocks  # the owner that last allocated each block
        self._num_in_use = [0]  # per owner: blocks with a reference
        self._ref_counts = [0] * num_blocks
        # Lowest id first, so block ids are predictable in tests and logs.
        self._free_heap = list(range(num_blocks))
        self._free_set = set(self._free_heap)
        # Cached blocks in release order: the first entry is the least recently used.
        self._cached_lru: OrderedDict[int, None] = OrderedDict()
        # Blocks whose content is published in the prefix tree (cached or in use).
        self._published: set[int] = set()

    def add_owner(self, on_evict: Callable[[int], None]) -> int:
        """Another user of this allocator's blocks (a KV group); returns its owner id."""
        self._evict_callbacks.append(on_evict)
        self._num_in_use.append(0)
        return len(self._evict_callbacks) - 1

    # -- queries -----------------------------------------------------------------------------
    def owner(self, block_id: int) -> int:
        """The owner that allocated the block last (meaningful while it is in use or cached)."""
        return self._owners[block_id]

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_published(self, block_id: int) -> bool:
        return block_id in self._published

    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: truly free plus evictable cached ones."""
        return len(self._free_set) + len(self._cached_lru)

    def num_cached_blocks(self) -> int:
        return len(self._cached_lru)

    def num_blocks_in_use(self, owner: int | None = None) -> int:
        """Referenced blocks, of one owner or (None) of all."""
        if owner is None:
            return self.num_blocks - self.num_free_blocks()
        return self._num_in_use[owner]

    def num_published_blocks(self, owner: int | None = None) -> int:
        if owner is None:
            return len(self._published)
        return sum(1 for block_id in self._published if self._owners[block_id] == owner)

    def cached_block_ids(self) -> list[int]:
        """Cached blocks, next to be evicted first."""
        return list(self._cached_lru)

    # -- lifecycle ---------------------------------------------------------------------------
    def allocate(self, num_blocks: int, owner: int = 0) -> list[int]:
        """Take `num_blocks` fresh blocks (reference count 1) for `owner`, all or none.

        Free blocks go first so the cache survives as long as possible; then cached blocks are
        evicted least recently used first.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks():
            raise OutOfBlocksError(f"need {num_blocks} blocks, {self.num_free_blocks()} free or evictable")
        block_ids: list[int] = []
        for _ in range(num_blocks):
            if self._free_heap:
                block_id = heapq.heappop(self._free_heap)
                self._free_set.discard(block_id)
            else:
                block_id, _ = self._cached_lru.popitem(last=False)
                self._published.discard(block_id)
                self._evict_callbacks[self._owners[block_id]](block_id)
            self._ref_counts[block_id] = 1
            self._owners[block_id] = owner
            self._num_in_use[owner] += 1
            block_ids.append(block_id)
        return block_ids

    def incref(self, block_id: int) -> None:
        """Share a block. A cached block leaves the LRU (it is no longer evictable)."""
        if block_id in self._free_set:
            raise ValueError(f"block {block_id} is free: it holds nothing to share")
        if self._ref_counts[block_id] == 0:
            del self._cached_lru[block_id]
            self._num_in_use[self._owners[block_id]] += 1
        self._ref_counts[block_id] += 1

    def decref(self, block_id: int) -> None:
        """Drop one reference. At zero a published block becomes cached (most recently used)."""
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} has no reference to drop")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] > 0:
            return
        self._num_in_use[self._owners[block_id]] -= 1
        if block_id in self._published:
            self._cached_lru[block_id] = None
        else:
            heapq.heappush(self._free_heap, block_id)
            self._free_set.add(block_id)

    def free(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self.decref(block_id)

    def mark_published(self, block_id: int) -> None:
        """The prefix tree now holds this block's content; only blocks in use can be published."""
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not in use and cannot be published")
        self._published.add(block_id)

    def unmark_published(self, block_id: int) -> None:
        """The tree dropped this block's key without eviction; when unreferenced it is freed."""
        self._published.discard(block_id)
        if block_id in self._cached_lru:
            del self._cached_lru[block_id]
            heapq.heappush(self._free_heap, block_id)
            self._free_set.add(block_id)

    def check_integrity(self) -> None:
        num_in_use = sum(1 for count in self._ref_counts if count > 0)
        assert all(count >= 0 for count in self._ref_counts), "negative reference count"
        assert len(self._free_heap) == len(self._free_set), "duplicate block on the free heap"
        assert self._free_set.isdisjoint(self._cached_lru), "block both free and cached"
        for block_id in self._free_set:
            assert self._ref_counts[block_id] == 0, f"block {block_id} both free and referenced"
            assert block_id not in self._published, f"free block {block_id} still published"
        for block_id in self._cached_lru:
            assert self._ref_counts[block_id] == 0, f"block {block_id} both cached and referenced"
            assert block_id in self._published, f"cached block {block_id} not published"
        total = len(self._free_set) + len(self._cached_lru) + num_in_use
        assert total == self.num_blocks, f"free + cached + in use = {total} != {self.num_blocks}"
        for owner, counted in enumerate(self._num_in_use):
            held = sum(
                1
                for block_id, count in enumerate(self._ref_counts)
                if count and self._owners[block_id] == owner
            )
            assert counted == held, f"owner {owner}: {counted} blocks counted in use, {held} referenced"
