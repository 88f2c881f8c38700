"""Prefix tree of published KV blocks, keyed by a hash chain over block tokens.

key(block i) = SHA-256(key(block i-1), salt, tokens of block i), with a fixed all-zero root key.
A key names the whole token prefix up to the end of its block, so equal keys mean equal KV.
The salt scopes sharing: two tenants with different salts never match each other's blocks.

Published nodes are full blocks, plus (with partial commit) a finished non-full last block.
`match` walks full blocks by key; then, for the first block it cannot match whole, it may use
a node it shares only in part (partial reuse): the longest common prefix of the lookup's next
tokens with the tokens of a child of the last matched node. Such a block must be copied before
the caller writes into it; the tree only reports it.

Worked case (block 32; A committed a 49-token prompt; B, the same prompt, looks up 48 tokens,
prompt[:-1]):

    token     0                 32                 48 49
    A         [ a0: full block   ][ a1: 17 tokens     ]     a1 in the tree only with partial commit
    B lookup  [ 0 ............. 32][ 32 ........ 48 )        16 tail tokens, a prefix of a1's 17

    reuse off, commit on : a0 shared; a1 is not an exact match (16 != 17 tokens)     -> 32
    reuse off, commit off: a1 not in the tree                                        -> 32
    reuse on,  commit on : a0 shared; B's 16 tokens are a1's first 16, a1 copied    -> 48
    reuse on,  commit off: only a0 is in the tree, nothing to take in part          -> 32

Without partial reuse a non-full node is still matched when the lookup's tail equals it exactly.
Hybrid models: a published block may also hold a snapshot of the recurrent state right after its
last token (`record_snapshot`), recorded with exactly the number of tokens it covers, so a lookup
can tell whether it may resume there (KVCacheManager prunes a match to such a point).

Eviction is the allocator's choice (LRU); the tree only forgets a block's key (`evict`), and with
it the block's snapshot.
A node whose parent was evicted stays findable by key: its key still names the same prefix,
so it becomes reachable again once the parent is re-published.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

ROOT_KEY = bytes(32)


def block_key(parent_key: bytes, token_ids: list[int] | tuple[int, ...], salt: bytes = b"") -> bytes:
    hasher = hashlib.sha256(parent_key)
    # The salt is length-prefixed so (salt, tokens) splits unambiguously.
    hasher.update(len(salt).to_bytes(8, "little"))
    hasher.update(salt)
    hasher.update(array("q", token_ids).tobytes())
    return hasher.digest()


@dataclass(frozen=True)
class PrefixNode:
    key: bytes
    parent_key: bytes
    token_ids: tuple[int, ...]
    salt: bytes
    block_id: int


@dataclass(frozen=True)
class PrefixMatch:
    block_ids: list[int]  # leading full blocks matched whole: share them
    num_matched_tokens: int  # len(block_ids) * T + num_partial_tokens
    partial_block_id: int | None = None  # a block whose leading tokens are reused: copy it
    num_partial_tokens: int = 0


class PrefixTree:
    def __init__(self, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self._nodes: dict[bytes, PrefixNode] = {}
        self._key_of_block: dict[int, bytes] = {}
        # Children by (parent key, first token): partial reuse needs a common first token, so a
        # lookup scans only the few children that can share anything.
        self._child_keys: dict[tuple[bytes, int], set[bytes]] = {}
        # block id -> tokens its recurrent-state snapshot covers (the prefix up to the block's end)
        self._snapshot_lens: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def key_of_block(self, block_id: int) -> bytes | None:
        return self._key_of_block.get(block_id)

    def block_ids(self) -> list[int]:
        """Every published block."""
        return list(self._key_of_block)

    def node(self, key: bytes) -> PrefixNode | None:
        return self._nodes.get(key)

    def match(
        self, token_ids: list[int], salt: bytes = b"", allow_partial_reuse: bool = False
    ) -> PrefixMatch:
        """Longest cached prefix of `token_ids` (pass prompt[:-1]); changes nothing."""
        size = self.tokens_per_block
        parent_key = ROOT_KEY
        block_ids: list[int] = []
        for start in range(0, len(token_ids) - size + 1, size):
            node = self._nodes.get(block_key(parent_key, token_ids[start : start + size], salt))
            if node is None:
                break
            block_ids.append(node.block_id)
            parent_key = node.key
        num_full_tokens = len(block_ids) * size
        # [0, num_full_tokens) shared whole; the next at most T tokens may match in part.
        next_tokens = token_ids[num_full_tokens : num_full_tokens + size]
        if not next_tokens:
            return PrefixMatch(block_ids, num_full_tokens)
        partial = self._match_partial(parent_key, next_tokens, salt, allow_partial_reuse)
        if partial is None:
            return PrefixMatch(block_ids, num_full_tokens)
        block_id, num_tokens = partial
        return PrefixMatch(block_ids, num_full_tokens + num_tokens, block_id, num_tokens)

    def _match_partial(
        self, parent_key: bytes, next_tokens: list[int], salt: bytes, allow_partial_reuse: bool
    ) -> tuple[int, int] | None:
        if len(next_tokens) < self.tokens_per_block:
            exact = self._nodes.get(block_key(parent_key, next_tokens, salt))
            if exact is not None:
                return exact.block_id, len(next_tokens)
        if not allow_partial_reuse:
            return None
        best: tuple[int, int] | None = None
        # Sorted keys: ties go to the same block on every run.
        for child_key in sorted(self._child_keys.get((parent_key, next_tokens[0]), ())):
            child = self._nodes[child_key]
            if child.salt != salt:
                continue
            num_common = _common_prefix_len(child.token_ids, next_tokens)
            if num_common > 0 and (best is None or num_common > best[1]):
                best = (child.block_id, num_common)
        return best

    def insert(self, parent_key: bytes, token_ids: list[int], salt: bytes, block_id: int) -> bytes:
        """Publish `block_id` as holding `token_ids` after the prefix named by `parent_key`.

        Returns the block's key. If the key is already published (by this or another block),
        the tree is unchanged: the first publisher keeps it. The caller tells the allocator.
        """
        if not 0 < len(token_ids) <= self.tokens_per_block:
            raise ValueError(f"a block holds 1..{self.tokens_per_block} tokens, got {len(token_ids)}")
        key = block_key(parent_key, token_ids, salt)
        if key in self._nodes:
            return key
        if block_id in self._key_of_block:
            raise ValueError(f"block {block_id} is already published under another key")
        self._nodes[key] = PrefixNode(key, parent_key, tuple(token_ids), salt, block_id)
        self._key_of_block[block_id] = key
        self._child_keys.setdefault((parent_key, token_ids[0]), set()).add(key)
        return key

    def record_snapshot(self, block_id: int, num_tokens: int) -> None:
        """The published `block_id` now holds the state after the first `num_tokens` tokens."""
        key = self._key_of_block.get(block_id)
        if key is None:
            raise ValueError(f"block {block_id} is not published; it cannot hold a snapshot")
        num_block_tokens = len(self._nodes[key].token_ids)
        if num_tokens < num_block_tokens or (num_tokens - num_block_tokens) % self.tokens_per_block:
            raise ValueError(
                f"block {block_id} of {num_block_tokens} tokens cannot end at token {num_tokens}"
            )
        self._snapshot_lens[block_id] = num_tokens

    def snapshot_len(self, block_id: int) -> int | None:
        """Tokens covered by the snapshot `block_id` holds, or None when it holds none."""
        return self._snapshot_lens.get(block_id)

    def num_snapshots(self) -> int:
        return len(self._snapshot_lens)

    def evict(self, block_id: int) -> None:
        """Forget the key of `block_id` and its snapshot (no-op when it has none)."""
        self._snapshot_lens.pop(block_id, None)
        key = self._key_of_block.pop(block_id, None)
        if key is None:
            return
        node = self._nodes.pop(key)
        child_index = (node.parent_key, node.token_ids[0])
        siblings = self._child_keys[child_index]
        siblings.discard(key)
        if not siblings:
            del self._child_keys[child_index]

    def check_integrity(self) -> None:
        assert len(self._nodes) == len(self._key_of_block), "nodes and block index differ in size"
        num_children = 0
        for key, node in self._nodes.items():
            assert node.key == key, "node stored under a foreign key"
            assert self._key_of_block.get(node.block_id) == key, f"block {node.block_id} index stale"
            child_index = (node.parent_key, node.token_ids[0])
            assert key in self._child_keys.get(child_index, set()), "node missing from its parent"
            assert 0 < len(node.token_ids) <= self.tokens_per_block, "node with a bad token count"
        for child_keys in self._child_keys.values():
            assert child_keys, "empty child set kept"
            num_children += len(child_keys)
        assert num_children == len(self._nodes), "child index lists unknown keys"
        for block_id, num_tokens in self._snapshot_lens.items():
            snapshot_key = self._key_of_block.get(block_id)
            assert snapshot_key is not None, f"snapshot on unpublished block {block_id}"
            num_block_tokens = len(self._nodes[snapshot_key].token_ids)
            assert num_tokens >= num_block_tokens, f"snapshot of block {block_id} covers too few tokens"
            assert (num_tokens - num_block_tokens) % self.tokens_per_block == 0, (
                f"snapshot of block {block_id} at {num_tokens} is not at the block's end"
            )


def _common_prefix_len(left: tuple[int, ...], right: list[int]) -> int:
    num_common = 0
    for left_token, right_token in zip(left, right, strict=False):
        if left_token != right_token:
            break
        num_common += 1
    return num_common
