"""Causal short convolution over a batch of sequences that resume from saved states.

Dimensions: B sequences, N new tokens in the batch, K = conv_kernel_size, R = K - 1 past inputs
a state keeps, E hidden size, S snapshots taken in this pass.

The convolution of token t reads the inputs at t-R .. t. For sequence b with c cached and n new
tokens, those past inputs come from its state slot (the R inputs before position c, zeros at
position 0) and from the batch's new inputs:

    buffer = [ state of seq 0 (R rows) | ... | state of seq B-1 | new inputs, all N rows ]
    window of new token j of seq b = rows for relative positions j-R .. j
        relative r < 0  -> row b*R + R + r          (its saved state)
        relative r >= 0 -> row B*R + start[b] + r   (this pass's inputs)

The state after a token is the last R rows of its window, which gives both the state each
sequence carries on (after its last new token) and snapshots at block ends inside a prompt.
`prepare_recurrent` packs these indices once per step; every convolution layer reuses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata


@dataclass(frozen=True)
class RecurrentMetadata:
    slot_ids: torch.Tensor  # [B] state slot of each sequence
    window_rows: torch.Tensor  # [N, K] rows of the buffer each new token's convolution reads
    last_token_indices: torch.Tensor  # [B] each sequence's last new token
    snapshot_token_indices: torch.Tensor  # [S] token after which a snapshot is taken
    snapshot_block_ids: torch.Tensor  # [S] KV block whose snapshot it becomes


def prepare_recurrent(
    slot_ids: Sequence[int],
    snapshots: Sequence[Sequence[tuple[int, int]]],
    num_cached_tokens: Sequence[int],
    attention: AttentionMetadata,
    kernel_size: int,
) -> RecurrentMetadata:
    """snapshots[b]: (num_tokens, block_id) pairs, the state after sequence b's first num_tokens
    tokens to store as block_id's snapshot; num_cached_tokens[b] < num_tokens <= its context length."""
    device = attention.positions.device
    num_seqs, width = len(slot_ids), kernel_size - 1
    starts = attention.query_start_loc[:-1]  # [B]
    relative = attention.query_offsets[:, None] - width + torch.arange(kernel_size, device=device)  # [N, K]
    seq_ids = attention.query_seq_ids[:, None]  # [N, 1]
    window_rows = torch.where(
        relative < 0, seq_ids * width + width + relative, num_seqs * width + starts[seq_ids] + relative
    )
    token_indices: list[int] = []
    block_ids: list[int] = []
    start_list = attention.query_start_loc.tolist()
    for seq_index, seq_snapshots in enumerate(snapshots):
        for num_tokens, block_id in seq_snapshots:
            offset = num_tokens - 1 - num_cached_tokens[seq_index]
            if not 0 <= offset < start_list[seq_index + 1] - start_list[seq_index]:
                raise ValueError(f"sequence {seq_index}: no new token ends a snapshot at {num_tokens}")
            token_indices.append(start_list[seq_index] + offset)
            block_ids.append(block_id)

    def as_tensor(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=device)

    return RecurrentMetadata(
        slot_ids=as_tensor(slot_ids),
        window_rows=window_rows,
        last_token_indices=attention.logits_indices,
        snapshot_token_indices=as_tensor(token_indices),
        snapshot_block_ids=as_tensor(block_ids),
    )


def short_conv(
    inputs: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    snapshots: torch.Tensor,
    metadata: RecurrentMetadata,
) -> torch.Tensor:
    """inputs [N, E], weight [E, K] (depthwise), slots [S, R, E] and snapshots [blocks, R, E] of
    this layer (views of the pool) -> outputs [N, E]; saves each sequence's new state and the
    requested snapshots."""
    num_seqs = int(metadata.slot_ids.shape[0])
    width, hidden = slots.shape[1], slots.shape[2]
    past = slots[metadata.slot_ids].reshape(num_seqs * width, hidden)  # [B*R, E]
    buffer = torch.cat((past, inputs), dim=0)  # [B*R + N, E]
    windows = buffer[metadata.window_rows]  # [N, K, E]
    outputs = (windows * weight.t()[None]).sum(dim=1)  # [N, E]
    if bias is not None:
        outputs = outputs + bias
    # Indexed writes go through to the pool's storage; the windows were gathered already.
    slots[metadata.slot_ids] = windows[metadata.last_token_indices, 1:]
    if metadata.snapshot_block_ids.numel():
        snapshots[metadata.snapshot_block_ids] = windows[metadata.snapshot_token_indices, 1:]
    return outputs
