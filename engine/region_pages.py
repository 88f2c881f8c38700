"""Which pages of the KV pool a disaggregated prompt moves, and in which order.

Plain Python. Every KV group's pages lie in one pool (engine/kv_pool.GroupedKVPool), registered for
transfer as ONE region whose page is the pool's page: block b is region page b, whatever group
owns it. The transfer layer keeps moving lists of page indices of one region and never learns
what a group is. A one-group pool lists its prompt's blocks as it always did.

A prompt's pages go on the wire in one canonical order, the same on both sides: group by group,
block index ascending, HOLEs (blocks out of the window at the prompt's end) skipped. Both sides
release by the same rule at the prompt's end, so the holder's list and the puller's reservation
line up without sending the holes.

    group 0 (full):     b0 b1 b2   -> pages 0 | 1 | 2
    group 1 (window):   -- -- b2   -> page 7
    holder list:        [0, 1, 2, 7]; a puller that reuses block 0 takes positions 1..3
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv_cache import HOLE


@dataclass(frozen=True)
class RegionPages:
    tokens_per_block: int
    windows: tuple[int | None, ...]  # per group

    def num_holes(self, group: int, prompt_len: int) -> int:
        """Leading blocks of group `group` released once a prompt of prompt_len tokens is whole
        (the first decode query is at prompt_len; KVCacheManager.release_out_of_window)."""
        window = self.windows[group]
        num_blocks = -(-prompt_len // self.tokens_per_block)
        if window is None:
            return 0
        return min(max(0, (prompt_len - window + 1) // self.tokens_per_block), num_blocks - 1)

    def num_prompt_pages(self, prompt_len: int) -> int:
        """Pages a holder ships for a whole prompt of prompt_len tokens."""
        num_blocks = -(-prompt_len // self.tokens_per_block)
        return sum(num_blocks - self.num_holes(group, prompt_len) for group in range(len(self.windows)))

    def pages(self, group_block_ids: Sequence[Sequence[int]], first_block: int = 0) -> list[int]:
        """The region pages of every group's blocks from first_block on, in canonical order."""
        return [
            block_id
            for block_ids in group_block_ids
            for block_id in block_ids[first_block:]
            if block_id != HOLE
        ]

    def pull_plan(
        self, group_block_ids: Sequence[Sequence[int]], num_cached_blocks: int
    ) -> tuple[list[int], list[int]]:
        """(positions in the holder's canonical list, this side's pages) for the blocks a puller
        must fill: every held block from num_cached_blocks on."""
        positions: list[int] = []
        destinations: list[int] = []
        position = 0
        for block_ids in group_block_ids:
            for index, block_id in enumerate(block_ids):
                if block_id == HOLE:
                    continue
                if index >= num_cached_blocks:
                    positions.append(position)
                    destinations.append(block_id)
                position += 1
        return positions, destinations
