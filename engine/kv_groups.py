"""KV groups: one logical cache per group of layers of one attention kind (docs/cache.md).

Plain Python (no torch). Each attention kind's layers (full; each window) are cut into groups of
the same number of layers (engine/kv_group_tables.make_kv_groups); a model with one kind (or a
cache told to ignore windows) has exactly one group and behaves exactly as one `KVCacheManager`.
`KVGroups` holds one manager per group, each with its own prefix tree, all over ONE shared
`BlockAllocator` (one page-id space: a page belongs to one group at a time), and makes every
multi-group operation all-or-nothing: it checks the shared free blocks first, then applies.

A sequence has one `BlockTable` per group (`GroupedTable`), all with the same num_tokens. Group 0
is the first group (the full one when the model has full layers); `GroupedTable.block_ids` is its
table's, which is all a one-group cache ever had.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import fields, replace

from engine.block_allocator import BlockAllocator, OutOfBlocksError
from engine.config import CacheConfig
from engine.kv_cache import HOLE, BlockTable, CopyOp, KVCacheManager, KVCacheStats, PromptAllocation
from engine.kv_group_sizing import sliding_blocks_needed
from engine.kv_group_tables import BlockCounts, GroupedAllocation, GroupedTable, KVGroup, ReusePlan
from engine.prefix_tree import ROOT_KEY, PrefixTree, block_key


class KVGroups:
    def __init__(
        self, config: CacheConfig, groups: Sequence[KVGroup], has_recurrent_state: bool = False
    ) -> None:
        """config.num_blocks: the one pool's pages, shared by every group. One group: a plain
        KVCacheManager with its own allocator, as before groups existed."""
        if not groups:
            raise ValueError("no KV groups")
        self.groups = tuple(groups)
        shared = None if len(groups) == 1 else BlockAllocator(config.num_blocks)
        self.managers = [
            KVCacheManager(config, has_recurrent_state, group.window, shared) for group in groups
        ]
        self.tokens_per_block = config.tokens_per_block
        self.stats = KVCacheStats()  # the sum over groups (prompt lookups: counted once)
        # "full" or "window<W>" per group (several groups may share a name: their kind), and the
        # kinds in group order, each once (metric labels, status): fixed with the groups.
        self._group_names = tuple(
            "full" if group.window is None else f"window{group.window}" for group in groups
        )
        self._kind_names = tuple(dict.fromkeys(self._group_names))

    @classmethod
    def of_manager(cls, manager: KVCacheManager) -> KVGroups:
        """One group around an existing manager (a caller that built its own cache)."""
        groups = cls(manager.config, [KVGroup(manager.sliding_window, ())], manager.has_recurrent_state)
        groups.managers = [manager]
        return groups

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def primary(self) -> KVCacheManager:
        """Group 0's manager: all there is for a one-group cache."""
        return self.managers[0]

    # Compatibility with code written for one manager (a one-group cache is exactly one).
    @property
    def config(self) -> CacheConfig:
        return self.primary.config

    @property
    def allocator(self) -> BlockAllocator:
        """The one allocator every group's manager shares."""
        return self.primary.allocator

    @property
    def tree(self) -> PrefixTree:
        return self.primary.tree

    # -- queries -----------------------------------------------------------------------------
    def group_names(self) -> tuple[str, ...]:
        """ "full" or "window<W>" per group (several groups may share a name: their kind)."""
        return self._group_names

    def kind_names(self) -> tuple[str, ...]:
        """The attention kinds, in group order, each once (metric labels, status)."""
        return self._kind_names

    def num_kind_blocks_in_use(self) -> BlockCounts:
        """Blocks in use per attention kind (kind_names): summed over the kind's groups."""
        in_use = dict.fromkeys(self.kind_names(), 0)
        for name, count in zip(self.group_names(), self.num_group_blocks_in_use(), strict=True):
            in_use[name] += count
        return tuple(in_use.values())

    def num_blocks(self) -> int:
        """Pages of the one pool every group shares."""
        return self.allocator.num_blocks

    def num_free_blocks(self) -> int:
        """Free plus evictable cached pages of the shared pool."""
        return self.allocator.num_free_blocks()

    def num_group_blocks_in_use(self) -> BlockCounts:
        return tuple(manager.num_blocks_in_use() for manager in self.managers)

    def num_blocks_in_use(self) -> int:
        return self.allocator.num_blocks_in_use()

    def num_blocks_cached(self) -> int:
        return self.allocator.num_cached_blocks()

    def blocks_needed(
        self,
        prompt_len: int,
        total_len: int,
        beam_width: int,
        is_decoding: bool = False,
        chunk_tokens: int | None = None,
    ) -> BlockCounts:
        """Per group, the most blocks one request holds at once (docs/cache.md, admission bound).

        A sliding group holds, while its prompt is prefilled in chunks of at most chunk_tokens
        (None: whole), the first query's window and the chunk; then at most ceil(W/T) + 1 blocks
        per beam (sliding_blocks_needed). A pulled prompt passes chunk_tokens 0: it arrives whole
        and takes only the first decode query's window. is_decoding: the bound from the first
        decode step on (the prompt phase is over)."""
        counts = []
        for manager, group in zip(self.managers, self.groups, strict=True):
            full = manager.blocks_needed(prompt_len, total_len, beam_width)
            if group.window is None:
                counts.append(full)
                continue
            sliding = sliding_blocks_needed(
                group.window,
                self.tokens_per_block,
                prompt_len,
                total_len,
                beam_width,
                chunk_tokens,
                is_decoding,
            )
            counts.append(min(full, sliding))
        return tuple(counts)

    def fits(self, needed: BlockCounts, available: int | None = None) -> bool:
        """The groups' needs, summed, fit the shared pool's pages (available: default the free
        and evictable ones)."""
        return sum(needed) <= (self.num_free_blocks() if available is None else available)

    # -- prompt ------------------------------------------------------------------------------
    @property
    def is_window_aware(self) -> bool:
        return any(group.window is not None for group in self.groups)

    def allocate_prompt(
        self,
        token_ids: list[int],
        salt: bytes = b"",
        allow_partial_reuse: bool | None = None,
        prune_to_snapshots: bool | None = None,
        reuse_prefix: bool = True,
        first_query_position: int | None = None,
        is_chunked: bool = False,
    ) -> GroupedAllocation:
        """Every group's blocks for a prompt, all reusing the same prefix. All-or-nothing.
        first_query_position: KVCacheManager.allocate_window_prompt's (a pulled prompt: its length).
        is_chunked: a prompt the caller prefills here chunk by chunk: its sliding groups take only
        the reused prefix's window now, each chunk's blocks come with extend_for_chunk.

        No window: KVCacheManager.allocate_prompt. With sliding groups, whole blocks only
        (plan_reuse): the full groups share the reused blocks, each sliding group only those its
        window still sees after them (HOLEs before)."""
        if not self.is_window_aware:
            before = [replace(self.primary.stats)]
            allocation = self.primary.allocate_prompt(
                token_ids, salt, allow_partial_reuse, prune_to_snapshots, reuse_prefix
            )
            self._add_deltas(before, count_lookups=True)
            num_pages = allocation.num_tokens_before_hybrid_pruning
            return GroupedAllocation(
                GroupedTable([allocation.table]), allocation.num_cached_tokens, allocation.num_cached_blocks,
                (allocation.copies,), num_pages, allocation.snapshot_block_id, num_pages, num_pages,
            )  # fmt: skip
        plan = self.plan_reuse(token_ids, salt) if reuse_prefix else ReusePlan([], 0, 0, 0)
        num_tokens = plan.num_blocks * self.tokens_per_block
        # The groups share one pool: check the fresh pages of all of them first, then pin every
        # page some group reuses, so that no group's allocation evicts another's reused page.
        size = self.tokens_per_block
        query = num_tokens if first_query_position is None else first_query_position
        num_allocated = -(-(num_tokens if is_chunked else len(token_ids)) // size)
        num_fresh, pinned = 0, list[int]()
        for manager, group in zip(self.managers, self.groups, strict=True):
            if group.window is None:
                first, num_group_blocks = 0, -(-len(token_ids) // size)
            else:
                num_dead = manager.num_out_of_window_blocks(query)
                first, num_group_blocks = max(0, min(num_dead, num_allocated - 1)), num_allocated
            nodes = [manager.tree.node(key) for key in plan.block_keys[first : plan.num_blocks]]
            pinned.extend(node.block_id for node in nodes if node is not None)
            num_fresh += num_group_blocks - max(first, plan.num_blocks)
        num_evictable = sum(1 for block_id in pinned if self.allocator.ref_count(block_id) == 0)
        if num_fresh > self.num_free_blocks() - num_evictable:
            raise OutOfBlocksError(
                f"prompt needs {num_fresh} new blocks, {self.num_free_blocks() - num_evictable} available"
            )
        for block_id in pinned:
            self.allocator.incref(block_id)
        allocations: list[PromptAllocation] = []
        before = [replace(manager.stats) for manager in self.managers]
        for manager, group in zip(self.managers, self.groups, strict=True):
            if group.window is None:
                allocation = manager.allocate_prompt(token_ids, salt, False, False, reuse_prefix, num_tokens)
            else:
                allocation = manager.allocate_window_prompt(
                    token_ids, plan.block_keys, plan.num_blocks, first_query_position,
                    num_tokens if is_chunked else None,
                )  # fmt: skip
            allocations.append(allocation)
        for block_id in pinned:
            self.allocator.decref(block_id)  # every one is held by its group's table now
        self._add_deltas(before, count_lookups=True)
        table = GroupedTable([allocation.table for allocation in allocations])
        if is_chunked and len(token_ids) > num_tokens:
            table.prompt_len = len(token_ids)
        return GroupedAllocation(
            table, num_tokens, plan.num_blocks,
            tuple(allocation.copies for allocation in allocations), num_tokens, None,
            plan.full_attention_tokens, plan.window_tokens,
        )  # fmt: skip

    def plan_reuse(self, token_ids: list[int], salt: bytes = b"") -> ReusePlan:
        """The reusable prefix of a prompt (lookup: token_ids[:-1], whole blocks) for a cache with
        sliding groups. The hash chain gives every block's key without a tree walk:
        - the full groups need every block before the prefix's end (their tree walk);
        - a sliding group needs only the blocks the window of the next query sees
          (KVCacheManager.is_window_reusable);
        the reused prefix is the longest that both allow (not monotone: a shorter prefix's window
        reaches blocks a longer one's does not)."""
        size = self.tokens_per_block
        lookup = token_ids[:-1]
        block_keys: list[bytes] = []
        parent_key = ROOT_KEY
        for start in range(0, len(lookup) - size + 1, size):
            parent_key = block_key(parent_key, lookup[start : start + size], salt)
            block_keys.append(parent_key)
        sliding = [manager for manager, group in zip(self.managers, self.groups, strict=True) if group.window]
        full = [
            manager for manager, group in zip(self.managers, self.groups, strict=True) if group.window is None
        ]

        def is_allowed(num_blocks: int) -> bool:
            return all(manager.is_window_reusable(block_keys, num_blocks) for manager in sliding)

        allowed = [num for num in range(len(block_keys) + 1) if is_allowed(num)]
        num_window = max(allowed)
        num_full = min(
            (len(manager.tree.match(lookup, salt).block_ids) for manager in full), default=num_window
        )
        num_blocks = max(num for num in allowed if num <= num_full)
        return ReusePlan(block_keys, num_blocks, num_full * size, num_window * size)

    def commit(
        self, table: GroupedTable, token_ids: list[int], salt: bytes = b"", snapshot_lens: Iterable[int] = ()
    ) -> list[CopyOp]:
        """Publish every group's held blocks; the snapshot copies are group 0's (hybrids have one)."""
        copies = self.primary.commit(table.tables[0], token_ids, salt, snapshot_lens)
        for manager, group_table in zip(self.managers[1:], table.tables[1:], strict=True):
            manager.commit(group_table, token_ids, salt)
        return copies

    def prompt_snapshots(
        self, table: GroupedTable, num_cached_tokens: int, prompt_len: int
    ) -> list[tuple[int, int]]:
        return self.primary.prompt_snapshots(table.tables[0], num_cached_tokens, prompt_len)

    # -- beams -------------------------------------------------------------------------------
    def reorder_beams(
        self, tables: list[GroupedTable], parent_indices: list[int]
    ) -> tuple[list[GroupedTable], tuple[list[CopyOp], ...]]:
        """KVCacheManager.reorder_beams in every group with the same parents; all-or-nothing: the
        copies each group needs are checked against its free blocks first."""
        for parent in parent_indices:
            if not 0 <= parent < len(tables):
                raise IndexError(f"parent index {parent} out of range for {len(tables)} tables")
        order = list(range(self.num_groups))
        if self.num_groups > 1:
            order = self._check_reorder_fits(tables, parent_indices)
        before = [replace(manager.stats) for manager in self.managers]
        results = {
            group: self.managers[group].reorder_beams(
                [table.tables[group] for table in tables], parent_indices
            )
            for group in order
        }
        per_group = [results[group] for group in range(self.num_groups)]
        self._add_deltas(before)
        # Every group's first child of a parent inherits the parent's table: rebuild the grouping.
        new_tables = [
            GroupedTable([group_tables[beam] for group_tables, _ in per_group])
            for beam in range(len(parent_indices))
        ]
        return new_tables, tuple(copies for _, copies in per_group)

    def _check_reorder_fits(self, tables: list[GroupedTable], parent_indices: list[int]) -> list[int]:
        """The copies of every group fit the shared pool with what the dropped beams release;
        returns the order to run the groups in: most released net of copies first, so that no
        group runs short before a later one has released its pages."""
        counts = {parent: parent_indices.count(parent) for parent in set(parent_indices)}
        dropped = [index for index in range(len(tables)) if index not in counts]
        balance: dict[int, int] = {}  # group -> pages released minus pages copied
        for group, manager in enumerate(self.managers):
            group_tables = [table.tables[group] for table in tables]
            num_copies = sum(
                count - 1
                for parent, count in counts.items()
                if group_tables[parent].num_tokens % self.tokens_per_block
            )
            drops: dict[int, int] = {}
            for index in dropped:
                for block_id in group_tables[index].block_ids:
                    if block_id != HOLE:
                        drops[block_id] = drops.get(block_id, 0) + 1
            num_released = sum(
                1 for block_id, count in drops.items() if manager.allocator.ref_count(block_id) == count
            )
            balance[group] = num_released - num_copies
        if self.num_free_blocks() + sum(balance.values()) < 0:
            num_copies = -min(0, sum(balance.values()))
            raise OutOfBlocksError(f"beams need {num_copies} more blocks than the KV pool has free")
        return sorted(balance, key=lambda group: -balance[group])

    # -- growth and release ------------------------------------------------------------------
    def extend_for_chunk(self, table: GroupedTable, end: int) -> int:
        """A chunked prompt's sliding groups take the blocks up to token `end` (the end of the
        chunk about to run); the blocks before it that its first query cannot see were released
        after the previous chunk. All-or-nothing across groups; returns the blocks taken.
        A table that is not being prefilled chunk by chunk (prompt_len 0) holds them already."""
        if not table.prompt_len:
            return 0
        if not 0 < end <= table.prompt_len:
            raise ValueError(f"chunk end {end} outside (0, {table.prompt_len}]")
        size = self.tokens_per_block
        needed = tuple(max(0, -(-end // size) - len(group_table.block_ids)) for group_table in table.tables)
        if not self.fits(needed):
            raise OutOfBlocksError(
                f"prompt chunk needs {list(needed)} blocks per KV group, {self.num_free_blocks()} free"
            )
        before = [replace(manager.stats) for manager in self.managers]
        for manager, group_table in zip(self.managers, table.tables, strict=True):
            if group_table.num_tokens < end:
                manager.append_slots(group_table, end - group_table.num_tokens)
        self._add_deltas(before)
        if all(group_table.num_tokens == table.prompt_len for group_table in table.tables):
            table.prompt_len = 0  # whole in every group: a plain table from now on
        return sum(needed)

    def append_slots(self, table: GroupedTable, num_tokens: int = 1) -> None:
        """One more slot in every group, then the blocks the new token's query no longer sees are
        released. All-or-nothing across groups."""
        size = self.tokens_per_block
        new_num_tokens = table.num_tokens + num_tokens
        needed = tuple(
            max(0, -(-new_num_tokens // size) - len(group_table.block_ids)) for group_table in table.tables
        )
        if not self.fits(needed):
            raise OutOfBlocksError(
                f"growth needs {needed} blocks per KV group, {self.num_free_blocks()} free"
            )
        before = [replace(manager.stats) for manager in self.managers]
        for manager, group_table in zip(self.managers, table.tables, strict=True):
            manager.append_slots(group_table, num_tokens)
            manager.release_out_of_window(group_table, new_num_tokens - 1)
        self._add_deltas(before)

    def release_out_of_window(self, table: GroupedTable, first_query_position: int) -> int:
        """Every sliding group releases what no query at or after the position sees."""
        return sum(
            manager.release_out_of_window(group_table, first_query_position)
            for manager, group_table in zip(self.managers, table.tables, strict=True)
        )

    def free(self, table: GroupedTable) -> None:
        for manager, group_table in zip(self.managers, table.tables, strict=True):
            manager.free(group_table)

    def empty_table(self) -> GroupedTable:
        return GroupedTable([BlockTable([], 0) for _ in self.managers])

    # -- stats -------------------------------------------------------------------------------
    def _add_deltas(self, before: list[KVCacheStats], count_lookups: bool = False) -> None:
        """Fold the groups' counter changes since `before` into self.stats: blocks and copies
        summed over groups, prompt lookups (the same in every group) from group 0 only."""
        lookups = {"prompt_tokens", "reused_tokens", "hybrid_pruned_tokens"}
        for item in fields(KVCacheStats):
            name = item.name
            if name == "peak_blocks_in_use":
                continue
            managers: Iterable[tuple[KVCacheManager, KVCacheStats]] = zip(self.managers, before, strict=True)
            if name in lookups:
                if not count_lookups:
                    continue
                managers = [(self.managers[0], before[0])]
            delta = sum(getattr(manager.stats, name) - getattr(stats, name) for manager, stats in managers)
            setattr(self.stats, name, getattr(self.stats, name) + delta)
        self.stats.peak_blocks_in_use = max(self.stats.peak_blocks_in_use, self.num_blocks_in_use())

    # -- checks ------------------------------------------------------------------------------
    def check_integrity(self, live_tables: Iterable[GroupedTable] | None = None) -> None:
        """Every group's allocator and tree; with live_tables, every group's reference counts,
        holes only where the group's window allows, and the same num_tokens in every group."""
        tables = None if live_tables is None else list(live_tables)
        for table in tables or []:
            # One page-id space: a page belongs to the group that allocated it, and to no other.
            for group, group_table in enumerate(table.tables):
                owner = self.managers[group].owner
                for block_id in group_table.block_ids:
                    assert block_id == HOLE or self.allocator.owner(block_id) == owner, (
                        f"page {block_id} in two KV groups (group {group}'s table, another's page)"
                    )
        for group, manager in enumerate(self.managers):
            group_tables = None if tables is None else [table.tables[group] for table in tables]
            manager.check_integrity(group_tables)
        for table in tables or []:
            assert len(table.tables) == self.num_groups, (
                f"{len(table.tables)} tables for {self.num_groups} groups"
            )
            if table.prompt_len:
                # Chunked prefill: full groups hold the whole prompt, sliding ones a prefix of it.
                for kv_group, group_table in zip(self.groups, table.tables, strict=True):
                    if kv_group.window is None:
                        assert group_table.num_tokens == table.prompt_len, (
                            f"full group holds {group_table.num_tokens} of {table.prompt_len} tokens"
                        )
                    else:
                        assert group_table.num_tokens <= table.prompt_len, (
                            f"sliding group holds {group_table.num_tokens} > {table.prompt_len} tokens"
                        )
                continue
            counts = {group_table.num_tokens for group_table in table.tables}
            assert len(counts) == 1, f"groups disagree on num_tokens: {counts}"
