"""How many blocks a KV group needs: a sliding group's per-request bound and the split of a memory
budget between groups (docs/cache.md, Sliding-window groups). Plain Python (no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.config import CacheConfig

if TYPE_CHECKING:
    from engine.kv_groups import KVGroup


def sliding_blocks_needed(
    window: int,
    tokens_per_block: int,
    prompt_len: int,
    total_len: int,
    beam_width: int,
    chunk_tokens: int | None = None,
    is_decoding: bool = False,
) -> int:
    """The most blocks one request holds at once in a sliding group of this window (docs/cache.md).

    Prefill, chunks of at most chunk_tokens C (None: the whole prompt at once): the first query's
    window and the chunk, positions [s - W + 1, s + C), at most ceil((W + C)/T) + 1 blocks, never
    more than the prompt's ceil(P/T). Decode: per beam the previous query's window and the new
    token's block, ceil(W/T) + 1, never more than ceil(S/T). is_decoding: the decode bound only."""
    size = tokens_per_block
    num_prompt = -(-prompt_len // size)
    num_total = -(-max(total_len, prompt_len) // size)
    per_beam = min(num_total, -(-window // size) + 1)
    prefill = num_prompt if chunk_tokens is None else min(num_prompt, -(-(window + chunk_tokens) // size) + 1)
    return max(0 if is_decoding else prefill, beam_width * per_beam)


def group_cache_configs(
    cache: CacheConfig,
    groups: Sequence[KVGroup],
    page_bytes: Sequence[int],
    max_len: int,
    chunk_tokens: int | None = None,
    beam_width: int = 1,
) -> list[CacheConfig]:
    """Each group's cache config, its num_blocks fitted to its share of the memory budget.

    One group: cache.fitted_to(its page bytes), as a one-pool cache always was. Sized by a block
    count (no max_pool_bytes): every group gets num_blocks. Sized by memory: the budget is split in
    proportion to what one request of max_len tokens (beam_width beams) holds at its peak in each
    group, its blocks times the group's page bytes: a full group ceil(L/T) blocks (beam_width of
    them: the shared prompt plus each beam's tail), a sliding group sliding_blocks_needed's bound
    for prefill chunks of chunk_tokens (None: the whole prompt at once, so as many as a full
    group's). Then each share is divided by the group's page bytes."""
    if len(groups) == 1:
        return [cache.fitted_to(page_bytes[0])]
    if cache.max_pool_bytes is None:
        return [cache for _ in groups]
    size = cache.tokens_per_block
    num_shared = max_len // size
    full = num_shared + beam_width * (-(-max_len // size) - num_shared)  # KVCacheManager.blocks_needed
    demands = [
        (
            full
            if group.window is None
            else min(
                full, sliding_blocks_needed(group.window, size, max_len, max_len, beam_width, chunk_tokens)
            )
        )
        * page
        for group, page in zip(groups, page_bytes, strict=True)
    ]
    total = sum(demands)
    return [
        replace(cache, max_pool_bytes=max(1, cache.max_pool_bytes * demand // total)).fitted_to(page)
        for demand, page in zip(demands, page_bytes, strict=True)
    ]
