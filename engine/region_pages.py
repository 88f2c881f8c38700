"""Which bytes of the KV pools a disaggregated prompt moves: blocks as pages of one region.

Plain Python. The KV groups' pools (engine/kv_pool.GroupedKVPool) lie back to back in one buffer,
registered for transfer as ONE region whose page ("unit") is the greatest common divisor of the
groups' page sizes: group g's block b is the k_g units from offset_g + b * k_g on (k_g = its page
bytes / unit). The transfer layer keeps moving lists of page indices of one region and never
learns what a group is. A one-group pool is its own region: unit = its page, block b = unit b.

A prompt's pages go on the wire in one canonical order, the same on both sides: group by group,
block index ascending, HOLEs (blocks out of the window at the prompt's end) skipped, each block
as its k_g units. Both sides release by the same rule at the prompt's end, so the holder's list
and the puller's reservation line up without sending the holes.

    group 0 (full, k=1):   b0 b1 b2       -> units u0 | u1 | u2
    group 1 (W, k=2):      -- -- b2       -> units u3 u4
    holder list:           [u0, u1, u2, u3, u4]; a puller that reuses block 0 takes positions 1..4
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv_cache import HOLE


@dataclass(frozen=True)
class RegionPages:
    tokens_per_block: int
    windows: tuple[int | None, ...]  # per group
    units_per_page: tuple[int, ...]  # k_g
    unit_offsets: tuple[int, ...]  # offset_g, in units

    def num_holes(self, group: int, prompt_len: int) -> int:
        """Leading blocks of group `group` released once a prompt of prompt_len tokens is whole
        (the first decode query is at prompt_len; KVCacheManager.release_out_of_window)."""
        window = self.windows[group]
        num_blocks = -(-prompt_len // self.tokens_per_block)
        if window is None:
            return 0
        return min(max(0, (prompt_len - window + 1) // self.tokens_per_block), num_blocks - 1)

    def num_prompt_units(self, prompt_len: int) -> int:
        """Units a holder ships for a whole prompt of prompt_len tokens."""
        num_blocks = -(-prompt_len // self.tokens_per_block)
        return sum(
            (num_blocks - self.num_holes(group, prompt_len)) * units
            for group, units in enumerate(self.units_per_page)
        )

    def units(self, group_block_ids: Sequence[Sequence[int]], first_block: int = 0) -> list[int]:
        """The region units of every group's blocks from first_block on, in canonical order."""
        result: list[int] = []
        for block_ids, units, offset in zip(
            group_block_ids, self.units_per_page, self.unit_offsets, strict=True
        ):
            for block_id in block_ids[first_block:]:
                if block_id != HOLE:
                    result.extend(range(offset + block_id * units, offset + (block_id + 1) * units))
        return result

    def pull_plan(
        self, group_block_ids: Sequence[Sequence[int]], num_cached_blocks: int
    ) -> tuple[list[int], list[int]]:
        """(positions in the holder's canonical list, this side's units) for the blocks a puller
        must fill: every held block from num_cached_blocks on."""
        positions: list[int] = []
        destinations: list[int] = []
        position = 0
        for block_ids, units, offset in zip(
            group_block_ids, self.units_per_page, self.unit_offsets, strict=True
        ):
            for index, block_id in enumerate(block_ids):
                if block_id == HOLE:
                    continue
                if index >= num_cached_blocks:
                    positions.extend(range(position, position + units))
                    destinations.extend(range(offset + block_id * units, offset + (block_id + 1) * units))
                position += units
        return positions, destinations
