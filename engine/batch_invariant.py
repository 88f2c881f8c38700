"""Batch-invariant kernels: a token's numbers do not depend on what else is in the batch.

A plain `x @ W.T` on the CPU (MKL, oneDNN) picks its kernel and its reduction blocking from the
number of rows: the same row gives different float32 (and float64) bits alone, next to 3 others,
or next to 63. Attention over a padded batch has the same problem twice: the score matmul's
blocking follows the longest key length in the batch, and so does the P @ V reduction. Measured
on this build (torch 2.13, MKL 2024.2): a row alone (gemv) differs from the same row among 4 or
more; a fixed-shape matmul gives the same bits for a row at any position with any neighbours, and
a batched matmul of fixed-shape items gives every item the same bits whatever the item count.

So every matmul here has a shape that depends on nothing but constants:
- `invariant_linear`: rows padded to a multiple of ROW_CHUNK and run as a batched matmul of
  [ROW_CHUNK, in] x [in, out] items.
- `invariant_attention`: keys and values are read page by page (T keys per item). Queries come
  in units: a decode token alone (G rows per kv head), prompt tokens PROMPT_UNIT tokens at a time
  (G * PROMPT_UNIT rows). A token's role, not the batch, decides its unit size, so a prompt token
  computed in a chunk, after a reused prefix or next to other prompts gives the same bits. Scores
  [rows, D] x [D, T] and P @ V [rows, T] x [T, D] are fixed-shape items; the row maximum is exact
  in any order. The softmax denominator and the output are summed per page, then over pages, by
  `tree_sum`: a pairwise tree with a fixed leaf for each page, so pages past a row's position (or
  padding up to the batch's longest context) only ever add exact zeros. torch's own `sum` is not
  safe here: measured, summing a middle axis whose inner size is under 16 or so changes bits with
  the axis length and the row count.

The cost is padding (a lone decode row runs as ROW_CHUNK rows) and more, smaller matmuls in
attention; `bench serve` reports it. See docs/engine.md, "Batch invariance".

Dimensions: N new tokens, U query units, Q tokens per unit, P pages per unit (padded), T tokens
per page, H query heads, Hkv kv heads, G = H / Hkv, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.kv_pool import KEY, VALUE

ROW_CHUNK = 16  # rows per matmul item in invariant_linear
PROMPT_UNIT = 32  # prompt tokens per attention query unit
MAX_PROMPT_ITEMS = 1024  # (unit, page) items per attention slice: bounds the scores' memory
MAX_DECODE_ITEMS = 16384


def invariant_linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """hidden [M, in] -> [M, out], each row computed as one row of a [ROW_CHUNK, in] matmul."""
    num_rows, in_features = hidden.shape
    num_chunks = -(-num_rows // ROW_CHUNK)
    padded = hidden.new_zeros((num_chunks * ROW_CHUNK, in_features))
    padded[:num_rows] = hidden
    items = padded.view(num_chunks, ROW_CHUNK, in_features)
    output = torch.bmm(items, weight.t().expand(num_chunks, -1, -1))  # [chunks, ROW_CHUNK, out]
    output = output.view(num_chunks * ROW_CHUNK, -1)[:num_rows]
    return output if bias is None else output + bias


class RowChunkedLinear(nn.Linear):
    """nn.Linear whose rows do not depend on the other rows of the batch (same parameters)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() != 2:
            raise ValueError(f"RowChunkedLinear takes [rows, features], got shape {tuple(hidden.shape)}")
        return invariant_linear(hidden, self.weight, self.bias)


def make_batch_invariant(model: nn.Module) -> nn.Module:
    """Turns every nn.Linear of `model` into a RowChunkedLinear in place (weights untouched)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowChunkedLinear
    return model


@dataclass(frozen=True)
class AttentionSlice:
    """Query units of one shape that are computed together (one slice bounds the memory)."""

    token_index: torch.Tensor  # [U, Q] index into the N new tokens; padding points at row N
    block_table: torch.Tensor  # [U, P] pages of each unit's context, padded with block 0
    key_mask: torch.Tensor  # [U, P, Q, T] bool: unit row q may see key t of page p


@dataclass(frozen=True)
class InvariantLayout:
    slices: tuple[AttentionSlice, ...]


def prepare_invariant_layout(
    seqs: Sequence[tuple[Sequence[int], int, int]],
    is_decode: Sequence[bool],
    tokens_per_block: int,
    device: torch.device | str,
) -> InvariantLayout:
    """seqs: (block_ids, num_cached_tokens, num_new_tokens) in batch order, as prepare_attention."""
    # (unit size, [(token indices, positions, block ids)]) per shape
    units: dict[int, list[tuple[list[int], list[int], Sequence[int]]]] = {1: [], PROMPT_UNIT: []}
    start = 0
    for (block_ids, num_cached, num_new), decode in zip(seqs, is_decode, strict=True):
        size = 1 if decode else PROMPT_UNIT
        if decode and num_new != 1:
            raise ValueError(f"a decode sequence feeds one token, got {num_new}")
        for first in range(0, num_new, size):
            count = min(size, num_new - first)
            positions = list(range(num_cached + first, num_cached + first + count))
            num_pages = positions[-1] // tokens_per_block + 1
            units[size].append(
                (list(range(start + first, start + first + count)), positions, block_ids[:num_pages])
            )
        start += num_new
    num_tokens = start
    slices: list[AttentionSlice] = []
    for size, limit in ((PROMPT_UNIT, MAX_PROMPT_ITEMS), (1, MAX_DECODE_ITEMS)):
        group = units[size]
        begin = 0
        while begin < len(group):
            end, max_pages = begin, 0
            while end < len(group) and (end - begin + 1) * max(max_pages, len(group[end][2])) <= max(
                limit, len(group[end][2])
            ):
                max_pages = max(max_pages, len(group[end][2]))
                end += 1
            slices.append(
                _make_slice(group[begin:end], size, max_pages, num_tokens, tokens_per_block, device)
            )
            begin = end
    return InvariantLayout(tuple(slices))


def _make_slice(
    group: list[tuple[list[int], list[int], Sequence[int]]],
    size: int,
    max_pages: int,
    num_tokens: int,
    tokens_per_block: int,
    device: torch.device | str,
) -> AttentionSlice:
    token_index = [indices + [num_tokens] * (size - len(indices)) for indices, _, _ in group]
    # A padding row sits at position 0: it sees key 0, so its softmax stays finite; it is never read.
    positions = [pos + [0] * (size - len(pos)) for _, pos, _ in group]
    block_table = [list(pages) + [0] * (max_pages - len(pages)) for _, _, pages in group]
    position_tensor = torch.tensor(positions, dtype=torch.long, device=device)  # [U, Q]
    key_positions = torch.arange(max_pages * tokens_per_block, device=device).view(
        max_pages, tokens_per_block
    )
    key_mask = key_positions[None, :, None, :] <= position_tensor[:, None, :, None]  # [U, P, Q, T]
    return AttentionSlice(
        token_index=torch.tensor(token_index, dtype=torch.long, device=device),
        block_table=torch.tensor(block_table, dtype=torch.long, device=device),
        key_mask=key_mask,
    )


def tree_sum(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` as a pairwise tree whose leaves are the indices along it: appending zeros
    (a longer padded axis) or changing the other axes never changes a result's bits."""
    tensor = tensor.movedim(dim, 0)
    while tensor.shape[0] > 1:
        if tensor.shape[0] % 2:
            tensor = torch.cat((tensor, tensor.new_zeros((1, *tensor.shape[1:]))))
        tensor = tensor[0::2] + tensor[1::2]
    return tensor[0]


def invariant_attention(
    query: torch.Tensor, kv_layer: torch.Tensor, layout: InvariantLayout, scale: float
) -> torch.Tensor:
    """query [N, H, D] (rotary applied), kv_layer [blocks, 2, T, Hkv, D] holding the new tokens'
    K/V -> [N, H, D]; see the module docstring for why every shape is fixed."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, tokens_per_block = kv_layer.shape[3], kv_layer.shape[2]
    group = num_heads // num_kv_heads
    softmax_dtype = torch.promote_types(query.dtype, torch.float32)
    padded_query = torch.cat((query, query.new_zeros((1, num_heads, head_dim))))  # row N: padding
    output = query.new_empty((num_tokens + 1, num_heads, head_dim))
    for part in layout.slices:
        num_units, unit_size = part.token_index.shape
        num_pages = part.block_table.shape[1]
        rows = group * unit_size
        items = num_units * num_pages * num_kv_heads
        unit_query = padded_query[part.token_index].view(num_units, unit_size, num_kv_heads, group, head_dim)
        unit_query = unit_query.permute(0, 2, 3, 1, 4).reshape(num_units, 1, num_kv_heads, rows, head_dim)
        unit_query = unit_query.expand(-1, num_pages, -1, -1, -1).reshape(items, rows, head_dim)
        key_pages = kv_layer[:, KEY][part.block_table]  # [U, P, T, Hkv, D]
        value_pages = kv_layer[:, VALUE][part.block_table]
        keys = key_pages.permute(0, 1, 3, 4, 2).reshape(items, head_dim, tokens_per_block)
        values = value_pages.permute(0, 1, 3, 2, 4).reshape(items, tokens_per_block, head_dim)
        scores = torch.bmm(unit_query, keys).view(num_units, num_pages, num_kv_heads, group, unit_size, -1)
        scores = (scores * scale).to(softmax_dtype)
        scores = scores.masked_fill(~part.key_mask[:, :, None, None], float("-inf"))  # [U, P, Hkv, G, Q, T]
        row_max = scores.amax(dim=(1, 5), keepdim=True)  # exact in any order
        weights = torch.exp(scores - row_max)  # masked keys: exactly 0
        denominator = tree_sum(tree_sum(weights, dim=-1), dim=1)  # [U, Hkv, G, Q]: per page, then pages
        partial = torch.bmm(weights.to(query.dtype).view(items, rows, tokens_per_block), values)
        summed = tree_sum(partial.view(num_units, num_pages, num_kv_heads, group, unit_size, head_dim), dim=1)
        unit_output = (summed.to(softmax_dtype) / denominator[..., None]).to(query.dtype)  # [U, Hkv, G, Q, D]
        unit_output = unit_output.permute(0, 3, 1, 2, 4).reshape(num_units * unit_size, num_heads, head_dim)
        output[part.token_index.reshape(-1)] = unit_output
    return output[:num_tokens]
