"""Paged attention over the KV pool, for any mix of prefill and decode sequences in one batch.

Dimensions: B sequences, N new tokens in the batch (all sequences), Q most new tokens of one
sequence, M most blocks of one sequence, T tokens per block, K = M * T key slots per sequence,
H query heads, Hkv key/value heads, G = H / Hkv query heads per kv head, D head dim.

Token layout of one sequence b with c cached and n new tokens (positions):

    0 ........ c-1 | c ........ c+n-1
    already in pool | new: written to the pool, then each attends to [0, its position]

A layer with a sliding window W (its attention kind, engine/models/traits.py) attends to
[position - W + 1, position] instead (transformers' `kv_idx > q_idx - W`). The metadata carries one
key mask per window of the model (`sliding_windows`), so every layer of one kind shares it and a
cache that learns per-layer windows reads them from the same place.

`prepare_attention` packs the batch into tensors once per step; every layer reuses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.invariant_attention import InvariantLayout, invariant_attention, prepare_invariant_layout
from engine.kv_pool import KEY, VALUE

# (block_ids, num_cached_tokens, num_new_tokens) of one sequence
SequenceSpec = tuple[Sequence[int], int, int]


@dataclass(frozen=True)
class AttentionMetadata:
    tokens_per_block: int
    slot_mapping: torch.Tensor  # [N] block_id * T + offset where each new token's K/V goes
    # slot_mapping split into (block, offset), [N] each, once a pass: write_kv reads them in every layer.
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    positions: torch.Tensor  # [N] position of each new token in its sequence
    block_tables: torch.Tensor  # [B, M] block ids, padded with 0 (padding is masked out)
    context_lens: torch.Tensor  # [B] cached + new tokens
    query_start_loc: torch.Tensor  # [B+1] sequence b's new tokens are [start[b], start[b+1])
    logits_indices: torch.Tensor  # [B] index in [0, N) of each sequence's last new token
    query_seq_ids: torch.Tensor  # [N] sequence of each new token
    query_offsets: torch.Tensor  # [N] index of each new token among its sequence's new tokens
    key_mask: torch.Tensor | None  # [B, Q, K] bool: padded query q of sequence b may see key slot k
    # Set in batch-invariant mode: paged_attention then runs engine/invariant_attention.py's kernel
    # (and key_mask, which only the padded kernel reads, is None).
    invariant: InvariantLayout | None = None
    # Per sliding window W of the model: key_mask with the keys at or before position - W hidden
    # (padded kernel only; the invariant layout holds its own per-window masks).
    window_key_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # KV groups (engine/kv_groups.py): this is group 0's; by_group[g - 1] is group g's (same tokens
    # and positions, its own block tables).
    by_group: tuple[AttentionMetadata, ...] = ()

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV group `group` (a layer's: GroupedKVPool.group_of_layer)."""
        return self if group == 0 else self.by_group[group - 1]

    def key_mask_for(self, sliding_window: int | None) -> torch.Tensor:
        """[B, Q, K] keys a query may see in a layer of this window (None: full attention)."""
        if sliding_window is None:
            assert self.key_mask is not None
            return self.key_mask
        if sliding_window not in self.window_key_masks:
            raise ValueError(f"no attention metadata for sliding window {sliding_window}")
        return self.window_key_masks[sliding_window]

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def num_new_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def prepare_attention(
    seqs: Sequence[SequenceSpec],
    tokens_per_block: int,
    device: torch.device | str,
    is_decode: Sequence[bool] | None = None,
    beam_group_sizes: Sequence[int] | None = None,
    sliding_windows: Sequence[int] = (),
    native_attention: bool = False,
) -> AttentionMetadata:
    """is_decode: one flag per sequence (a decode step feeds one generated token) selects the
    batch-invariant kernel; None keeps the padded one. beam_group_sizes: per decode sequence the
    beam width W of its request, whose W beams are consecutive (their shared pages are read once).
    sliding_windows: the model's distinct windows (ModelConfig.sliding_windows). native_attention: the
    invariant kernel's tokens, decode and prompt, run the compiled kernel (engine/native_kernels.py)."""
    if not seqs:
        raise ValueError("seqs must hold at least one sequence")
    slots: list[int] = []
    positions: list[int] = []
    query_seq_ids: list[int] = []
    query_offsets: list[int] = []
    query_start_loc = [0]
    context_lens: list[int] = []
    for seq_index, (block_ids, num_cached_tokens, num_new_tokens) in enumerate(seqs):
        context_len = num_cached_tokens + num_new_tokens
        if num_new_tokens < 1 or num_cached_tokens < 0:
            raise ValueError(
                f"sequence {seq_index}: num_new_tokens must be >= 1 and num_cached_tokens >= 0, "
                f"got {num_new_tokens} and {num_cached_tokens}"
            )
        if len(block_ids) * tokens_per_block < context_len:
            raise ValueError(
                f"sequence {seq_index}: {len(block_ids)} blocks of {tokens_per_block} cannot hold "
                f"{context_len} tokens"
            )
        new_positions = range(num_cached_tokens, context_len)
        slots.extend(
            block_ids[p // tokens_per_block] * tokens_per_block + p % tokens_per_block for p in new_positions
        )
        positions.extend(new_positions)
        query_seq_ids.extend([seq_index] * num_new_tokens)
        query_offsets.extend(range(num_new_tokens))
        query_start_loc.append(query_start_loc[-1] + num_new_tokens)
        context_lens.append(context_len)

    # Only the blocks the context actually spans are gathered; trailing reserved blocks are not.
    max_blocks = max(-(-length // tokens_per_block) for length in context_lens)
    block_table_rows = [
        list(block_ids[:max_blocks]) + [0] * (max_blocks - min(len(block_ids), max_blocks))
        for block_ids, _, _ in seqs
    ]

    def as_tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    positions_tensor = as_tensor(positions)
    query_seq_tensor = as_tensor(query_seq_ids)
    query_offset_tensor = as_tensor(query_offsets)
    start_tensor = as_tensor(query_start_loc)
    max_query_len = max(
        right - left for left, right in zip(query_start_loc, query_start_loc[1:], strict=False)
    )

    invariant = None
    key_mask = None
    window_key_masks: dict[int, torch.Tensor] = {}
    if is_decode is not None:
        invariant = prepare_invariant_layout(
            seqs, is_decode, tokens_per_block, device, beam_group_sizes, sliding_windows, native_attention
        )
    else:
        # A padded query slot keeps position 0, so it sees key 0 and its softmax stays finite;
        # its output is never read.
        padded_positions = torch.zeros((len(seqs), max_query_len), dtype=torch.long, device=device)  # [B, Q]
        padded_positions[query_seq_tensor, query_offset_tensor] = positions_tensor
        key_slots = torch.arange(max_blocks * tokens_per_block, device=device)  # [K]
        key_mask = key_slots[None, None, :] <= padded_positions[:, :, None]  # [B, Q, K]
        for window in sliding_windows:
            in_window = key_slots[None, None, :] > padded_positions[:, :, None] - window  # [B, Q, K]
            window_key_masks[window] = key_mask & in_window

    return AttentionMetadata(
        tokens_per_block=tokens_per_block,
        slot_mapping=as_tensor(slots),
        slot_blocks=as_tensor([slot // tokens_per_block for slot in slots]),
        slot_offsets=as_tensor([slot % tokens_per_block for slot in slots]),
        positions=positions_tensor,
        block_tables=as_tensor(block_table_rows),
        context_lens=as_tensor(context_lens),
        query_start_loc=start_tensor,
        logits_indices=start_tensor[1:] - 1,
        query_seq_ids=query_seq_tensor,
        query_offsets=query_offset_tensor,
        key_mask=key_mask,
        invariant=invariant,
        window_key_masks=window_key_masks,
    )


def write_kv(
    kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: AttentionMetadata
) -> None:
    """Stores the new tokens' keys and values in the pool.

    kv_layer [num_blocks, 2, T, Hkv, D] (a view of the pool), key and value [N, Hkv, D].
    """
    block_ids, offsets = metadata.slot_blocks, metadata.slot_offsets  # [N] each
    # Indexing a view in place writes through to the pool's storage.
    kv_layer[:, KEY][block_ids, offsets] = key
    kv_layer[:, VALUE][block_ids, offsets] = value


def paged_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query [N, H, D] (rotary applied), kv_layer [num_blocks, 2, T, Hkv, D] already holding the
    new tokens' K/V -> attention output [N, H, D]; a layer with a sliding window sees only its
    last `sliding_window` positions."""
    if metadata.invariant is not None:
        return invariant_attention(query, kv_layer, metadata.invariant, scale, sliding_window)
    key_mask = metadata.key_mask_for(sliding_window)
    num_seqs, max_query_len, num_key_slots = key_mask.shape
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_layer.shape[3]
    group = num_heads // num_kv_heads

    def gather(kind: int) -> torch.Tensor:
        pages = kv_layer[:, kind][metadata.block_tables]  # [B, M, T, Hkv, D]
        keys = pages.reshape(num_seqs, num_key_slots, num_kv_heads, head_dim)  # [B, K, Hkv, D]
        return keys.permute(0, 2, 1, 3).contiguous()  # [B, Hkv, K, D]

    keys, values = gather(KEY), gather(VALUE)

    padded = query.new_zeros((num_seqs, max_query_len, num_heads, head_dim))  # [B, Q, H, D]
    padded[metadata.query_seq_ids, metadata.query_offsets] = query
    # Query head h reads kv head h // G, as Hugging Face's repeat_kv does. The G query heads of a
    # kv head are stacked with the queries so each matmul is a plain batched one over [B, Hkv]:
    # a broadcast over G instead made torch copy the keys G times on every layer.
    grouped = padded.view(num_seqs, max_query_len, num_kv_heads, group, head_dim)
    grouped = grouped.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group * max_query_len, head_dim)

    scores = torch.matmul(grouped, keys.transpose(-1, -2)) * scale  # [B, Hkv, G*Q, K]
    scores = scores.view(num_seqs, num_kv_heads, group, max_query_len, num_key_slots)
    scores = scores.masked_fill(~key_mask[:, None, None], float("-inf"))  # [B, Hkv, G, Q, K]
    # bfloat16 scores are normalised in float32; float32 and float64 keep their own precision.
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
    probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(query.dtype)
    probs = probs.view(num_seqs, num_kv_heads, group * max_query_len, num_key_slots)
    output = torch.matmul(probs, values)  # [B, Hkv, G*Q, D]
    output = output.view(num_seqs, num_kv_heads, group, max_query_len, head_dim)
    output = output.permute(0, 3, 1, 2, 4).reshape(num_seqs, max_query_len, num_heads, head_dim)
    return output[metadata.query_seq_ids, metadata.query_offsets]  # [N, H, D]
