"""The engine's logical KV cache: block tables per sequence over a shared, ref-counted pool.

Plain Python (no torch). `KVCacheManager` decides which block every token's KV lives in; the
physical pool (`kv_pool.py`) only executes the `CopyOp`s it returns. Rules it keeps:
- a block with more than one reference is full and never written again;
- a sequence only writes into its own last block, which is private (reference count 1);
- a partly reused block is copied into a private block before anything writes there
  (copy-on-write); apply the returned copies before the next forward pass and before the next
  call that allocates, since the copy source may be an unreferenced cached block;
- every operation that takes blocks is all-or-nothing: `OutOfBlocksError` leaves the cache
  exactly as it was.
A sliding-window group's manager (`sliding_window`) releases blocks no future query can see
(`release_out_of_window`); they leave a leading run of `HOLE`s in the table (docs/cache.md).
For a hybrid model (`has_recurrent_state`), a prompt's match is pruned to where a recurrent-state
snapshot exists (engine/snapshot_pruning.py), and `commit` records the snapshots a prefill stored.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from engine.block_allocator import BlockAllocator, OutOfBlocksError
from engine.config import CacheConfig
from engine.prefix_tree import ROOT_KEY, PrefixTree, block_key
from engine.snapshot_pruning import prune_to_snapshot

__all__ = [
    "HOLE",
    "BlockTable",
    "CopyOp",
    "KVCacheManager",
    "KVCacheStats",
    "OutOfBlocksError",
    "PromptAllocation",
    "num_distinct_blocks",
]

HOLE = -1  # a released block of a sliding-window table: out of every future query's window


@dataclass
class BlockTable:
    """One sequence (a prompt or one beam); slots 0..num_tokens-1 are assigned.

    Invariant: len(block_ids) == ceil(num_tokens / T); in a sliding-window group the leading
    entries may be HOLEs (released, out of the window).
    """

    block_ids: list[int]
    num_tokens: int


@dataclass(frozen=True)
class CopyOp:
    """The pool copies block `src_block` into block `dst_block` (whole block)."""

    src_block: int
    dst_block: int


@dataclass(frozen=True)
class PromptAllocation:
    table: BlockTable  # num_tokens == len(prompt)
    num_cached_tokens: int  # leading tokens whose KV is already there: skip them in prefill
    num_cached_blocks: int  # leading full blocks shared from the tree
    copies: list[CopyOp]  # copy-on-write of a partly reused block; apply before prefill
    # What the attention pages alone supported; equals num_cached_tokens unless a hybrid model's
    # snapshots cut the match shorter.
    num_tokens_before_hybrid_pruning: int = 0
    # Hybrid: the block whose snapshot is the state after num_cached_tokens (None: zeros, at 0).
    # Load it before the next call that allocates, like the copies.
    snapshot_block_id: int | None = None


@dataclass
class KVCacheStats:
    prompt_tokens: int = 0  # prompt tokens looked up, summed over allocate_prompt calls
    reused_tokens: int = 0  # prompt tokens found in the tree, summed over allocate_prompt calls
    new_blocks: int = 0  # blocks taken from the pool: fresh prompt blocks, copy targets, growth
    copied_blocks: int = 0  # CopyOps issued (copy-on-write and beam forks)
    beam_copied_blocks: int = 0  # of those, partial tail blocks copied for a forked beam
    peak_blocks_in_use: int = 0  # most blocks referenced at once since construction
    hybrid_pruned_tokens: int = 0  # tokens the pages held but no snapshot did (hybrid models)
    # KV groups (engine/kv_groups.py, counted there): tokens the full-attention layers could have
    # reused but a sliding group's window did not hold.
    window_pruned_tokens: int = 0


def num_distinct_blocks(tables: Iterable[BlockTable]) -> int:
    """Blocks held by a group of tables (one request's beams), shared blocks counted once."""
    return len({block_id for table in tables for block_id in table.block_ids} - {HOLE})


class KVCacheManager:
    def __init__(
        self,
        config: CacheConfig,
        has_recurrent_state: bool = False,
        sliding_window: int | None = None,
        allocator: BlockAllocator | None = None,
    ) -> None:
        """sliding_window: the window of every layer this manager's blocks serve (None: full
        attention, no block is ever released early). allocator: a page-id space shared with other
        KV groups' managers (this one registers as an owner of it); None: its own, of
        config.num_blocks blocks."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.config = config
        self.sliding_window = sliding_window
        self.has_recurrent_state = has_recurrent_state
        self.tokens_per_block = config.tokens_per_block
        self.tree = PrefixTree(config.tokens_per_block)
        if allocator is None:
            self.allocator = BlockAllocator(config.num_blocks, on_evict=self.tree.evict)
            self.owner = 0
        else:
            self.allocator = allocator
            self.owner = allocator.add_owner(self.tree.evict)
        self.is_shared = allocator is not None
        self.stats = KVCacheStats()

    # -- queries -----------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        """Free plus evictable cached blocks."""
        return self.allocator.num_free_blocks()

    def num_blocks_in_use(self) -> int:
        """Referenced blocks of this manager; unreferenced cached blocks do not count."""
        return self.allocator.num_blocks_in_use(self.owner)

    def blocks_needed(self, prompt_len: int, total_len: int, beam_width: int, reused_blocks: int = 0) -> int:
        """Upper bound on the blocks one request takes from the pool (DESIGN.md admission).

        floor(P/T) full prompt blocks are shared by all beams; each of W beams owns the rest of
        its ceil(S/T) blocks, the partial prompt tail included (copied per beam).
        """
        size = self.tokens_per_block
        num_shared = prompt_len // size
        num_per_beam = -(-max(total_len, prompt_len) // size) - num_shared
        return num_shared + beam_width * num_per_beam - reused_blocks

    # -- prompt ------------------------------------------------------------------------------
    def allocate_prompt(
        self,
        token_ids: list[int],
        salt: bytes = b"",
        allow_partial_reuse: bool | None = None,
        prune_to_snapshots: bool | None = None,
        reuse_prefix: bool = True,
        max_reused_tokens: int | None = None,
    ) -> PromptAllocation:
        """Blocks for a prompt, reusing what the tree holds. All-or-nothing.

        The lookup uses token_ids[:-1]: the last prompt token is always recomputed, so its
        logits exist and the block it lands in is always fresh.

            token      0 ........ k*T           k*T + m        P-1  P
            table      [ shared full blocks ][ copy | fresh ...          ]
                       num_cached_blocks = k  m tokens reused from a partly shared block
                       num_cached_tokens = k*T + m

        prune_to_snapshots (default: has_recurrent_state) cuts the match to a snapshot; a side
        that receives the prompt's final state instead (a generation worker) turns it off.
        reuse_prefix False looks nothing up (a scored prompt needs every position's logits).
        max_reused_tokens caps the lookup (KV groups reuse what every group holds).
        """
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        if allow_partial_reuse is None:
            allow_partial_reuse = self.config.enable_partial_reuse
        if prune_to_snapshots is None:
            prune_to_snapshots = self.has_recurrent_state
        lookup = token_ids[:-1][:max_reused_tokens] if reuse_prefix else []
        match = self.tree.match(lookup, salt, allow_partial_reuse)
        num_before_pruning, snapshot_block_id = match.num_matched_tokens, None
        if prune_to_snapshots:
            pruned = prune_to_snapshot(match, self.tree)
            match, snapshot_block_id = pruned.match, pruned.snapshot_block_id
        num_blocks = -(-len(token_ids) // self.tokens_per_block)
        num_fresh = num_blocks - len(match.block_ids)
        # The copy source is held for the duration of the call so no eviction below takes it.
        held_ids = list(match.block_ids)
        if match.partial_block_id is not None:
            held_ids.append(match.partial_block_id)
        num_held_evictable = sum(1 for block_id in held_ids if self.allocator.ref_count(block_id) == 0)
        num_available = self.allocator.num_free_blocks() - num_held_evictable
        if num_fresh > num_available:
            raise OutOfBlocksError(f"prompt needs {num_fresh} new blocks, {num_available} available")
        for block_id in held_ids:
            self.allocator.incref(block_id)
        fresh_ids = self.allocator.allocate(num_fresh, self.owner)
        copies: list[CopyOp] = []
        if match.partial_block_id is not None:
            copies.append(CopyOp(match.partial_block_id, fresh_ids[0]))
            self.allocator.decref(match.partial_block_id)
        table = BlockTable(match.block_ids + fresh_ids, len(token_ids))
        self.stats.prompt_tokens += len(token_ids)
        self.stats.reused_tokens += match.num_matched_tokens
        self.stats.hybrid_pruned_tokens += num_before_pruning - match.num_matched_tokens
        self.stats.new_blocks += num_fresh
        self.stats.copied_blocks += len(copies)
        self._track_peak()
        return PromptAllocation(
            table,
            match.num_matched_tokens,
            len(match.block_ids),
            copies,
            num_before_pruning,
            snapshot_block_id,
        )

    def is_window_reusable(self, block_keys: list[bytes], num_blocks: int) -> bool:
        """Sliding group: the tree holds each of the first num_blocks blocks (keys: the prompt's
        hash chain) that the first query after them, at num_blocks * T, still sees."""
        first = self.num_out_of_window_blocks(num_blocks * self.tokens_per_block)
        return all(self.tree.node(key) is not None for key in block_keys[first:num_blocks])

    def allocate_window_prompt(
        self,
        token_ids: list[int],
        block_keys: list[bytes],
        num_reused_blocks: int,
        first_query_position: int | None = None,
        num_allocated_tokens: int | None = None,
    ) -> PromptAllocation:
        """Sliding group: a prompt reusing its first num_reused_blocks blocks, of which only those
        inside the window of the first query are looked up (is_window_reusable must hold); the
        ones before are HOLEs from the start. first_query_position: default the end of the reused
        prefix (a prefill resumes there); a prompt whose KV arrives whole (a pulled one) passes its
        length, so no block outside the first decode query's window is ever taken. All-or-nothing.
        num_allocated_tokens: the table covers only tokens [0, num_allocated_tokens) (default the
        whole prompt); a prefill takes the rest chunk by chunk (append_slots).

            block   0 ...... dead-1 | dead ... k-1 | k ........
                    HOLE            | shared       | fresh
        """
        size = self.tokens_per_block
        num_tokens = len(token_ids) if num_allocated_tokens is None else num_allocated_tokens
        if not num_reused_blocks * size <= num_tokens <= len(token_ids):
            raise ValueError(
                f"num_allocated_tokens {num_tokens} outside [{num_reused_blocks * size}, {len(token_ids)}]"
            )
        num_blocks = -(-num_tokens // size)
        query = num_reused_blocks * size if first_query_position is None else first_query_position
        dead = max(0, min(self.num_out_of_window_blocks(query), num_blocks - 1))
        nodes = [self.tree.node(key) for key in block_keys[dead:num_reused_blocks]]
        shared_ids = [node.block_id for node in nodes if node is not None]
        if len(shared_ids) != max(0, num_reused_blocks - dead):
            raise ValueError(f"blocks {dead}..{num_reused_blocks - 1} are not all in the tree")
        num_fresh = num_blocks - max(dead, num_reused_blocks)
        num_held_evictable = sum(1 for block_id in shared_ids if self.allocator.ref_count(block_id) == 0)
        num_available = self.allocator.num_free_blocks() - num_held_evictable
        if num_fresh > num_available:
            raise OutOfBlocksError(f"prompt needs {num_fresh} new blocks, {num_available} available")
        for block_id in shared_ids:
            self.allocator.incref(block_id)
        table = BlockTable(
            [HOLE] * dead + shared_ids + self.allocator.allocate(num_fresh, self.owner), num_tokens
        )
        self.stats.prompt_tokens += len(token_ids)
        self.stats.reused_tokens += num_reused_blocks * size
        self.stats.new_blocks += num_fresh
        self._track_peak()
        return PromptAllocation(
            table, num_reused_blocks * size, num_reused_blocks, [], num_reused_blocks * size
        )

    def prompt_snapshots(
        self, table: BlockTable, num_cached_tokens: int, prompt_len: int
    ) -> list[tuple[int, int]]:
        """(num_tokens, block_id): the snapshots a prefill of tokens [num_cached_tokens,
        prompt_len) stores, at each block end it computes and, when the last block will be
        published (partial commit), at the prompt's end. Each goes to the block it ends."""
        size = self.tokens_per_block
        ends = list(range((num_cached_tokens // size + 1) * size, prompt_len + 1, size))
        if self.config.enable_partial_commit and prompt_len % size:
            ends.append(prompt_len)
        return [(end, table.block_ids[(end - 1) // size]) for end in ends]

    def commit(
        self, table: BlockTable, token_ids: list[int], salt: bytes = b"", snapshot_lens: Iterable[int] = ()
    ) -> list[CopyOp]:
        """Publish the blocks holding token_ids (their KV must be written already).

        Full blocks always; the non-full last block only with enable_partial_commit. A key
        already published by another block is left to it (this block stays private).
        snapshot_lens: prompt positions whose snapshot this table's block (the one ending there)
        holds; each is recorded on the published block. When another block owns the key and
        has no snapshot, the returned copies (src: this table's block) give it this one's.
        """
        if len(token_ids) > table.num_tokens:
            raise ValueError(f"{len(token_ids)} tokens to commit but the table holds {table.num_tokens}")
        size = self.tokens_per_block
        num_full = len(token_ids) // size
        parent_key = ROOT_KEY
        published: dict[int, bytes] = {}  # end of block -> its key
        for index in range(num_full):
            block_tokens = token_ids[index * size : (index + 1) * size]
            if table.block_ids[index] == HOLE:
                # Released out of the window: the chain goes on, the block is not published.
                parent_key = block_key(parent_key, block_tokens, salt)
                continue
            parent_key = self._publish(parent_key, block_tokens, salt, table.block_ids[index])
            published[index * size + size] = parent_key
        if self.config.enable_partial_commit and len(token_ids) % size:
            tail_key = self._publish(
                parent_key, token_ids[num_full * size :], salt, table.block_ids[num_full]
            )
            published[len(token_ids)] = tail_key
        snapshot_copies: list[CopyOp] = []
        for num_tokens in snapshot_lens:
            key = published.get(num_tokens)
            node = None if key is None else self.tree.node(key)
            if node is None or self.tree.snapshot_len(node.block_id) is not None:
                continue  # not published, or its owner already holds the same state
            own_block_id = table.block_ids[(num_tokens - 1) // size]
            if node.block_id != own_block_id:
                snapshot_copies.append(CopyOp(own_block_id, node.block_id))
            self.tree.record_snapshot(node.block_id, num_tokens)
        return snapshot_copies

    def _publish(self, parent_key: bytes, token_ids: list[int], salt: bytes, block_id: int) -> bytes:
        key = block_key(parent_key, token_ids, salt)
        if self.tree.node(key) is not None:
            return key
        old_key = self.tree.key_of_block(block_id)
        if old_key is not None:
            old_node = self.tree.node(old_key)
            if old_node is not None and len(old_node.token_ids) == self.tokens_per_block:
                raise ValueError(f"block {block_id} is published with other tokens")
            # A published partial block has since grown: it is re-published under the longer key.
            self.tree.evict(block_id)
        self.tree.insert(parent_key, token_ids, salt, block_id)
        self.allocator.mark_published(block_id)
        return key

    # -- beams -------------------------------------------------------------------------------
    def reorder_beams(
        self, tables: list[BlockTable], parent_indices: list[int]
    ) -> tuple[list[BlockTable], list[CopyOp]]:
        """New beam i continues tables[parent_indices[i]]. All-or-nothing.

        The first child of a parent inherits the parent's BlockTable object; each further child
        shares the parent's full blocks and gets a private copy of its partial last block.
        Parents with no child are freed (their tables emptied). Expansion of a prompt to W beams
        is reorder_beams([prompt_table], [0] * W). Use only the returned tables afterwards.
        """
        for parent in parent_indices:
            if not 0 <= parent < len(tables):
                raise IndexError(f"parent index {parent} out of range for {len(tables)} tables")
        num_children = Counter(parent_indices)
        dropped = [index for index in range(len(tables)) if num_children[index] == 0]
        num_copies = sum(
            count - 1 for parent, count in num_children.items() if self._has_partial_tail(tables[parent])
        )
        # Freeing the dropped parents first lets their blocks serve the copies; count exactly
        # which blocks that would release so a failure can be raised before any change.
        drops = Counter(
            block_id for index in dropped for block_id in tables[index].block_ids if block_id != HOLE
        )
        num_released = sum(
            1 for block_id, count in drops.items() if self.allocator.ref_count(block_id) == count
        )
        num_available = self.allocator.num_free_blocks() + num_released
        if num_copies > num_available:
            raise OutOfBlocksError(f"beams need {num_copies} new blocks, {num_available} available")
        for index in dropped:
            self.free(tables[index])
        fresh_ids = self.allocator.allocate(num_copies, self.owner)
        new_tables: list[BlockTable] = []
        copies: list[CopyOp] = []
        inherited: set[int] = set()
        for parent in parent_indices:
            table = tables[parent]
            if parent not in inherited:
                inherited.add(parent)
                new_tables.append(table)
                continue
            block_ids = list(table.block_ids)
            private_ids: list[int] = []
            if self._has_partial_tail(table):
                copy = CopyOp(block_ids.pop(), fresh_ids.pop(0))
                copies.append(copy)
                private_ids.append(copy.dst_block)
            for block_id in block_ids:
                if block_id != HOLE:
                    self.allocator.incref(block_id)
            new_tables.append(BlockTable(block_ids + private_ids, table.num_tokens))
        self.stats.new_blocks += num_copies
        self.stats.copied_blocks += num_copies
        self.stats.beam_copied_blocks += num_copies
        self._track_peak()
        return new_tables, copies

    def _has_partial_tail(self, table: BlockTable) -> bool:
        return table.num_tokens % self.tokens_per_block != 0

    # -- growth and release ------------------------------------------------------------------
    def append_slots(self, table: BlockTable, num_tokens: int = 1) -> None:
        """Assign `num_tokens` more slots, taking new blocks as needed. All-or-nothing."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if self._has_partial_tail(table) and self.allocator.ref_count(table.block_ids[-1]) != 1:
            raise ValueError(f"last block {table.block_ids[-1]} is shared; it cannot be written")
        new_num_tokens = table.num_tokens + num_tokens
        num_new_blocks = -(-new_num_tokens // self.tokens_per_block) - len(table.block_ids)
        table.block_ids.extend(self.allocator.allocate(max(num_new_blocks, 0), self.owner))
        table.num_tokens = new_num_tokens
        self.stats.new_blocks += max(num_new_blocks, 0)
        self._track_peak()

    def free(self, table: BlockTable) -> None:
        """Drop the table's references and empty it (a second free is a no-op).

        Blocks are released last first, so a sequence's tail is evicted before its head, which
        other prompts are more likely to share.
        """
        for block_id in reversed(table.block_ids):
            if block_id != HOLE:
                self.allocator.decref(block_id)
        table.block_ids = []
        table.num_tokens = 0

    def num_out_of_window_blocks(self, first_query_position: int) -> int:
        """Leading blocks no query at a position >= first_query_position can see (0: full
        attention). Query i sees key j when i - W < j <= i, so block b is dead once its last
        position bT + T - 1 <= first_query_position - W:

            position  0 ... bT+T-1 | ...... q-W+1 ...... q
                      dead blocks  |  window of query q
        """
        if self.sliding_window is None:
            return 0
        return max(0, (first_query_position - self.sliding_window + 1) // self.tokens_per_block)

    def release_out_of_window(self, table: BlockTable, first_query_position: int) -> int:
        """Release the blocks no future query of this table can see (every future query is at a
        position >= first_query_position); each leaves a HOLE. Returns how many were released."""
        num_dead = min(self.num_out_of_window_blocks(first_query_position), len(table.block_ids) - 1)
        num_released = 0
        for index in range(num_dead):
            block_id = table.block_ids[index]
            if block_id != HOLE:
                self.allocator.decref(block_id)
                table.block_ids[index] = HOLE
                num_released += 1
        return num_released

    def _track_peak(self) -> None:
        self.stats.peak_blocks_in_use = max(self.stats.peak_blocks_in_use, self.num_blocks_in_use())

    # -- checks ------------------------------------------------------------------------------
    def check_integrity(self, live_tables: Iterable[BlockTable] | None = None) -> None:
        """Allocator and tree consistent with each other; with `live_tables` (every table the
        caller holds), reference counts equal exactly the tables' uses of each block."""
        self.allocator.check_integrity()
        self.tree.check_integrity()
        if not self.has_recurrent_state:
            assert self.tree.num_snapshots() == 0, "snapshots in the tree of a model without recurrent layers"
        owner = self.owner if self.is_shared else None
        assert self.allocator.num_published_blocks(owner) == len(self.tree), "allocator and tree disagree"
        for block_id in self.tree.block_ids():
            assert self.allocator.owner(block_id) == self.owner, (
                f"block {block_id} published by another group"
            )
        if live_tables is None:
            return
        uses: Counter[int] = Counter()
        for table in live_tables:
            expected = -(-table.num_tokens // self.tokens_per_block)
            assert len(table.block_ids) == expected, (
                f"table of {table.num_tokens} tokens has {table.block_ids}"
            )
            num_holes = table.block_ids.count(HOLE)
            assert table.block_ids[:num_holes] == [HOLE] * num_holes, f"holes not leading: {table.block_ids}"
            # Holes come from release_out_of_window(q) with q <= num_tokens: a decode step's
            # (q = its new token, num_tokens - 1), a prompt's after a chunk or at its end (q = the
            # next query, num_tokens: a chunk-by-chunk table ends where it has been computed).
            num_dead = self.num_out_of_window_blocks(table.num_tokens)
            assert num_holes <= num_dead, (
                f"a hole inside the window: {table.block_ids} ({table.num_tokens} tokens)"
            )
            uses.update(block_id for block_id in table.block_ids if block_id != HOLE)
            if self._has_partial_tail(table):
                assert self.allocator.ref_count(table.block_ids[-1]) == 1, "shared partial last block"
        # A shared allocator (KV groups): this group's tables use only its own blocks, and each of
        # its blocks is referenced exactly by them (the other groups check theirs).
        for block_id in uses:
            assert self.allocator.owner(block_id) == self.owner, f"block {block_id} in two KV groups"
        for block_id in range(self.allocator.num_blocks):
            if self.allocator.owner(block_id) != self.owner:
                continue
            assert self.allocator.ref_count(block_id) == uses[block_id], (
                f"block {block_id}: {self.allocator.ref_count(block_id)} references, {uses[block_id]} uses"
            )
