"""KV groups' layout and per-sequence tables: which layers form a group, one sequence's table per
group, and the per-group views a transfer uses (docs/cache.md, Sliding-window groups). Plain Python.

Layer groups are equal in size (one page of the shared pool holds S layers of one group): each
attention kind's layers (full; each window) are cut into groups of S layers (`layers_per_group`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.kv_cache import HOLE, BlockTable, CopyOp

BlockCounts = tuple[int, ...]  # one count per group, in group order


@dataclass(frozen=True)
class KVGroup:
    """Layers sharing one attention kind: their KV-pool layer indices and their window. A page of
    the group holds its layers in slots 0..len(layer_indices)-1 of the pool's S slots."""

    window: int | None  # None: full attention
    layer_indices: tuple[int, ...]  # indices into ModelConfig.kv_layer_windows


def layers_per_group(kind_sizes: Sequence[int]) -> int:
    """S, the layers of one group (one page), given each attention kind's layer count.

    The greatest common divisor wastes nothing (every kind splits into whole groups); the smallest
    kind's count (vLLM's rule) gives the fewest groups, a kind whose count is not a multiple of it
    getting a last group with empty slots. The gcd unless it more than doubles the group count:
    Gemma 3 270M (3 full, 15 sliding): 3, no waste; Gemma 3 1B (4, 22): 2, 13 groups; Gemma 3 4B
    (5, 29): 5, 7 groups, 1 empty slot in 35 (the gcd 1 would give 34 groups)."""
    exact = math.gcd(*kind_sizes)
    smallest = min(kind_sizes)
    num_exact = sum(size // exact for size in kind_sizes)
    num_smallest = sum(-(-size // smallest) for size in kind_sizes)
    return exact if num_exact <= 2 * num_smallest else smallest


def make_kv_groups(
    kv_layer_windows: Sequence[int | None], is_window_aware: bool = True
) -> tuple[KVGroup, ...]:
    """Full layers first, then each window's, ascending, each kind cut into groups of
    layers_per_group layers in layer order. One kind of layers (no window, every layer of one
    window, or not window-aware): one group of every layer, the layout of a cache with no groups."""
    layers = tuple(range(len(kv_layer_windows)))
    windows = sorted({window for window in kv_layer_windows if window is not None})
    if not is_window_aware or not windows:
        return (KVGroup(None, layers),)
    kinds: list[tuple[int | None, tuple[int, ...]]] = []
    full = tuple(index for index in layers if kv_layer_windows[index] is None)
    if full:
        kinds.append((None, full))
    for window in windows:
        kinds.append((window, tuple(i for i in layers if kv_layer_windows[i] == window)))
    size = layers_per_group([len(kind_layers) for _, kind_layers in kinds])
    return tuple(
        KVGroup(window, kind_layers[start : start + size])
        for window, kind_layers in kinds
        for start in range(0, len(kind_layers), size)
    )


@dataclass
class GroupedTable:
    """One sequence's tables, tables[g] in group g; every table holds num_tokens tokens."""

    tables: list[BlockTable]
    # A prompt being prefilled chunk by chunk: its length. Its full groups hold it whole, its
    # sliding groups only up to the chunk that runs next (extend_for_chunk). 0: every table
    # holds num_tokens (a decoding beam, a pulled or pinned prompt).
    prompt_len: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_len or self.tables[0].num_tokens

    @property
    def block_ids(self) -> list[int]:
        """Group 0's block ids (a one-group cache's whole table)."""
        return self.tables[0].block_ids

    def group_block_ids(self) -> tuple[list[int], ...]:
        return tuple(table.block_ids for table in self.tables)


@dataclass(frozen=True)
class ReusePlan:
    block_keys: list[bytes]  # the hash chain of the lookup's whole blocks
    num_blocks: int  # whole blocks every group can continue from
    full_attention_tokens: int  # what the full-attention groups alone could reuse
    window_tokens: int  # what the sliding groups alone allow


@dataclass(frozen=True)
class GroupedAllocation:
    table: GroupedTable
    num_cached_tokens: int
    num_cached_blocks: int  # group 0's
    copies: tuple[list[CopyOp], ...]  # per group
    num_tokens_before_hybrid_pruning: int = 0
    snapshot_block_id: int | None = None
    # The diagnostic (docs/cache.md): what the full-attention layers alone could reuse, and what
    # the sliding layers alone allow (one group: both are what the pages supported).
    full_attention_reusable_tokens: int = 0
    window_reusable_tokens: int = 0


def num_group_blocks_held(tables: Iterable[GroupedTable], num_groups: int) -> BlockCounts:
    """Distinct blocks per group held by one request's tables (shared blocks once, holes none)."""
    held: list[set[int]] = [set() for _ in range(num_groups)]
    for table in tables:
        for group, group_table in enumerate(table.tables):
            held[group].update(group_table.block_ids)
    return tuple(len(ids - {HOLE}) for ids in held)


def counts_text(counts: Sequence[int]) -> str:
    """Per-group counts for a message: a bare number for one group (as before groups existed)."""
    return str(counts[0]) if len(counts) == 1 else str(list(counts))


def group_page_ids(table: GroupedTable) -> tuple[tuple[int, ...], ...]:
    """Every group's block ids (HOLE where a sliding group holds nothing); () for one group."""
    if len(table.tables) == 1:
        return ()
    return tuple(tuple(ids) for ids in table.group_block_ids())


def pages_to_pull(
    src_page_ids: Sequence[Sequence[int]], dst_page_ids: Sequence[Sequence[int]], num_cached_blocks: int
) -> list[tuple[list[int], list[int]]]:
    """Per group, (source pages, destination pages) a pull moves: blocks from num_cached_blocks on
    that both sides hold. Both sides release by the same rule at the prompt's end, so their holes
    are the same blocks; a mismatch is a protocol error."""
    pairs = []
    for group, (src_ids, dst_ids) in enumerate(zip(src_page_ids, dst_page_ids, strict=True)):
        if len(src_ids) != len(dst_ids) or any(
            (s == HOLE) != (d == HOLE) for s, d in zip(src_ids, dst_ids, strict=False)
        ):
            raise ValueError(f"KV group {group}: the two sides hold different blocks: {src_ids} vs {dst_ids}")
        indices = [index for index in range(num_cached_blocks, len(src_ids)) if src_ids[index] != HOLE]
        pairs.append(([src_ids[index] for index in indices], [dst_ids[index] for index in indices]))
    return pairs
