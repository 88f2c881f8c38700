"""Pruning a prefix match to a point where a hybrid model can resume.

A hybrid model resumes a prompt after n cached tokens only if it has both the attention layers'
K/V for tokens [0, n) (pages in the prefix tree) and the recurrent layers' state after exactly n
tokens (a snapshot, which exists only at the ends of published blocks). The attention match alone
may reach further than any snapshot:

    token        0            32            64      80
    attention    [ block a0    ][ block a1    ][ a2 part ]   match: 80 tokens
    snapshots                 ^32             ^64?           a1's snapshot missing (say)
    resume at    32 = the last matched block whose snapshot fits, then the pages at 32

The fixed point: take the last matched block whose snapshot fits inside the current length, cut the
attention match to that point, and repeat until neither step shortens it. The length before any
pruning is `num_tokens_before_hybrid_pruning`, the diagnostic that tells a user which of the two
limited reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.prefix_tree import PrefixMatch, PrefixTree


@dataclass(frozen=True)
class PrunedMatch:
    match: PrefixMatch  # what may be reused: pages and a snapshot agree on its length
    snapshot_block_id: int | None  # whose snapshot holds the state there (None: at token 0)
    num_tokens_before_hybrid_pruning: int  # what the attention pages alone supported


def prune_to_snapshot(match: PrefixMatch, tree: PrefixTree) -> PrunedMatch:
    ends = _snapshot_ends(match, tree)  # (num_tokens, block_id), ascending
    pruned = match
    snapshot_block_id: int | None = None
    while True:
        fitting = [end for end in ends if end[0] <= pruned.num_matched_tokens]
        num_tokens, snapshot_block_id = fitting[-1] if fitting else (0, None)
        shortened = truncate_match(pruned, num_tokens, tree.tokens_per_block)  # attention at that point
        if shortened.num_matched_tokens == pruned.num_matched_tokens:
            return PrunedMatch(pruned, snapshot_block_id, match.num_matched_tokens)
        pruned = shortened


def truncate_match(match: PrefixMatch, num_tokens: int, tokens_per_block: int) -> PrefixMatch:
    """The first `num_tokens` of a match (at most its length): whole blocks, then a part of the
    next matched block, which the caller then copies before writing (as for partial reuse)."""
    num_tokens = min(num_tokens, match.num_matched_tokens)
    num_full, remainder = divmod(num_tokens, tokens_per_block)
    if remainder == 0:
        return PrefixMatch(match.block_ids[:num_full], num_tokens)
    if num_full < len(match.block_ids):
        partial_block_id = match.block_ids[num_full]
    else:
        assert match.partial_block_id is not None
        partial_block_id = match.partial_block_id
    return PrefixMatch(match.block_ids[:num_full], num_tokens, partial_block_id, remainder)


def _snapshot_ends(match: PrefixMatch, tree: PrefixTree) -> list[tuple[int, int]]:
    """Matched blocks holding a snapshot that covers exactly the prefix up to their end."""
    size = tree.tokens_per_block
    ends = [
        (index * size + size, block_id)
        for index, block_id in enumerate(match.block_ids)
        if tree.snapshot_len(block_id) == index * size + size
    ]
    # A partly matched block's snapshot fits only when the lookup shares all of its tokens.
    if (
        match.partial_block_id is not None
        and tree.snapshot_len(match.partial_block_id) == match.num_matched_tokens
    ):
        ends.append((match.num_matched_tokens, match.partial_block_id))
    return ends
