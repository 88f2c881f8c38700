"""How many blocks a sliding-window KV group needs: its per-request bound (docs/cache.md,
Sliding-window groups). Plain Python (no torch)."""

from __future__ import annotations


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
