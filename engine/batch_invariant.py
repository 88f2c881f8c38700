"""Batch-invariant kernels: a token's numbers do not depend on what else is in the batch.

A plain `x @ W.T` on the CPU (MKL, oneDNN) picks its kernel from the number of rows: the same row
gives different float32 (and float64) bits alone, next to 2 others or next to 10; in float64 the
rows past a multiple of 4 take a remainder kernel. Attention over a padded batch
has the same problem twice: the score matmul's blocking follows the longest key length in the
batch, and so does the P @ V reduction. Measured on this build (torch 2.13, MKL 2024.2): one
matmul over M rows, M a multiple of 4, gives every row the same bits at any position next to any
rows; a fixed-shape matmul does too, and a batched matmul of fixed-shape
items gives every item the same bits whatever the item count.

So every matmul here has a shape that depends on nothing but the token's role and its own request,
or is one that was measured not to care:
- `invariant_linear`: where `rows_are_independent` measured it safe (once per shape, dtype and
  thread count, in the running process), prompt rows and beam requests' rows go through one
  matmul padded to a multiple of MATMUL_ROW_MULTIPLE rows, and a single-row decode request's row
  through a matrix-vector product of its own. Otherwise rows run as a batched matmul of
  fixed-shape [rows, in] x [in, out] items: prompt tokens (and a prompt's last row at the LM head)
  PROMPT_ROW_CHUNK to an item, in any grouping; a decoding request's W beams one item of W rows.
  Either way the grouping of the forward pass in flight is a `RowLayout` that ModelRunner sets
  (`row_layout`); without one, all rows are one padded matmul (or ROW_CHUNK-row items).
- `invariant_attention`: keys and values are read straight from the block table, K keys per
  item (PAGES_PER_ITEM pages for a decode token, PROMPT_PAGES_PER_ITEM for a prompt unit).
  Queries come in units: a decode token alone (G rows per kv head), prompt tokens PROMPT_UNIT
  tokens at a time (G * PROMPT_UNIT rows). A token's role, not the
  batch, decides its unit size, so a prompt token computed in a chunk, after a reused prefix or
  next to other prompts gives the same bits. Scores [rows, D] x [D, K] and P @ V [rows, K] x
  [K, D + 1] (a column of ones carries the softmax denominator) are fixed-shape items; the row
  maximum is exact in any order. The items are summed by `tree_sum`: a pairwise tree with a fixed
  leaf for each item, so items past a row's position (or padding up to the batch's longest
  context) only ever add exact zeros. torch's own `sum` is not
  safe here: measured, summing a middle axis whose inner size is under 16 or so changes bits with
  the axis length and the row count.

The cost is padding (up to 3 zero rows per matmul) and more, smaller matmuls in attention;
`bench invariance` measures it. See docs/engine.md, "Batch invariance".

Dimensions: N new tokens, U query units, Q tokens per unit, P pages per unit (padded), T tokens
per page, H query heads, Hkv kv heads, G = H / Hkv, D head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from engine.kv_pool import KEY, VALUE

MATMUL_ROW_MULTIPLE = 4  # one plain matmul: rows padded to a multiple of 4 (see rows_are_independent)
ROW_CHUNK = 16  # rows per matmul item in invariant_linear when no RowLayout is set
PROMPT_ROW_CHUNK = 64  # prompt rows per matmul item (measured: as fast as one plain matmul at 512 rows)
PROMPT_UNIT = 64  # prompt tokens per attention query unit
PROMPT_PAGES_PER_ITEM = 8  # keys of one prompt unit's attention item: 8 pages (256 keys at T = 32)
PAGES_PER_ITEM = 4  # keys of one decode token's attention item: 4 pages (128 keys at T = 32)
MAX_PROMPT_TOKEN_PAGES = 32768  # query tokens x pages per prompt slice: bounds the scores' memory
MAX_DECODE_ITEMS = 16384


@dataclass(frozen=True)
class RowGroups:
    """How the rows of one [M, features] tensor are computed, both ways (see invariant_linear)."""

    num_rows: int
    # Grouped: (rows per item, row indices [items * rows per item]; padding points at row num_rows)
    items: tuple[tuple[int, torch.Tensor], ...]
    # One matmul: prompt rows and the rows of beam requests, in order (None: no such row) ...
    matmul_rows: torch.Tensor | None
    all_matmul: bool  # ... which are all the rows, in order
    # ... and the rows of single-row (greedy or sampled) decode requests: a matrix-vector product each
    single_rows: torch.Tensor | None


@dataclass(frozen=True)
class RowLayout:
    """A forward pass's rows: `tokens` for [N, E] tensors, `sequences` for the LM head's [B, E]
    (when N == B every sequence has one row and the two groupings coincide)."""

    tokens: RowGroups
    sequences: RowGroups

    def groups_for(self, num_rows: int) -> RowGroups:
        if num_rows == self.tokens.num_rows:
            return self.tokens
        if num_rows == self.sequences.num_rows:
            return self.sequences
        raise ValueError(f"{num_rows} rows match neither the batch's tokens nor its sequences")


_ROW_LAYOUT: ContextVar[RowLayout | None] = ContextVar("beamsplit_row_layout", default=None)


@contextmanager
def row_layout(layout: RowLayout) -> Iterator[None]:
    """Linear layers called inside group their rows by `layout`."""
    token = _ROW_LAYOUT.set(layout)
    try:
        yield
    finally:
        _ROW_LAYOUT.reset(token)


def make_row_layout(
    num_new_tokens: Sequence[int], beam_group_sizes: Sequence[int], device: torch.device | str
) -> RowLayout:
    """num_new_tokens: per sequence, in batch order, its rows; beam_group_sizes: per sequence 0 for
    prompt tokens, else the size W of its request's decode group (W consecutive one-row sequences)."""
    token_prompt_rows: list[int] = []
    sequence_prompt_rows: list[int] = []
    decode_groups: list[tuple[int, int]] = []  # (first sequence, W)
    token_row = 0
    starts = []
    for index, (count, group_size) in enumerate(zip(num_new_tokens, beam_group_sizes, strict=True)):
        starts.append(token_row)
        if group_size == 0:
            token_prompt_rows.extend(range(token_row, token_row + count))
            sequence_prompt_rows.append(index)
        elif not decode_groups or index >= decode_groups[-1][0] + decode_groups[-1][1]:
            decode_groups.append((index, group_size))
        token_row += count
    token_decode = [[starts[first + beam] for beam in range(size)] for first, size in decode_groups]
    sequence_decode = [list(range(first, first + size)) for first, size in decode_groups]
    return RowLayout(
        tokens=_row_groups(token_row, token_prompt_rows, token_decode, device),
        sequences=_row_groups(len(num_new_tokens), sequence_prompt_rows, sequence_decode, device),
    )


def _row_groups(
    num_rows: int, prompt_rows: list[int], decode_items: list[list[int]], device: torch.device | str
) -> RowGroups:
    by_size: dict[int, list[int]] = {}
    for first in range(0, len(prompt_rows), PROMPT_ROW_CHUNK):
        chunk = prompt_rows[first : first + PROMPT_ROW_CHUNK]
        by_size.setdefault(PROMPT_ROW_CHUNK, []).extend(chunk + [num_rows] * (PROMPT_ROW_CHUNK - len(chunk)))
    for rows in decode_items:
        by_size.setdefault(len(rows), []).extend(rows)
    items = tuple(
        (size, torch.tensor(indices, dtype=torch.long, device=device))
        for size, indices in sorted(by_size.items())
    )
    single = [rows[0] for rows in decode_items if len(rows) == 1]
    matmul = sorted(prompt_rows + [row for rows in decode_items if len(rows) > 1 for row in rows])
    return RowGroups(
        num_rows,
        items,
        matmul_rows=torch.tensor(matmul, dtype=torch.long, device=device) if matmul else None,
        all_matmul=len(matmul) == num_rows,
        single_rows=torch.tensor(single, dtype=torch.long, device=device) if single else None,
    )


def _default_groups(num_rows: int, device: torch.device) -> RowGroups:
    num_chunks = -(-num_rows // ROW_CHUNK)
    indices = list(range(num_rows)) + [num_rows] * (num_chunks * ROW_CHUNK - num_rows)
    chunks = ((ROW_CHUNK, torch.tensor(indices, dtype=torch.long, device=device)),)
    return RowGroups(num_rows, chunks, matmul_rows=None, all_matmul=True, single_rows=None)


@functools.cache
def rows_are_independent(
    in_features: int, out_features: int, dtype: torch.dtype, device_type: str, num_threads: int
) -> bool:
    """Does one plain [M, in] x [in, out] matmul give every row the same bits for every M that is a
    multiple of MATMUL_ROW_MULTIPLE, wherever the row sits?

    Measured on this build (MKL 2024.2, 1 and 2 threads): yes for float32, float64 and bfloat16
    (every row, M from 4 to 2100, random offsets; shapes of every model here, 32000- and
    49152-row LM heads included); no for M of 1, 2, 3, 5, 6, 7, 9, 10, 11 (MKL's small-M kernels)
    nor, in float64, for any M that is not a multiple of 4 (its remainder kernel). Checked here once
    per shape, dtype and thread count in the process that runs, so a BLAS that behaves otherwise
    gets the grouped path. GPUs always get it (cuBLAS picks split-K by shape)."""
    if device_type != "cpu":
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    rows = torch.randn(300, in_features, generator=generator).to(dtype)
    reference = rows @ weight.t()
    for count, offset in (
        (4, 0),
        (4, 9),
        (8, 3),
        (12, 33),
        (16, 1),
        (36, 250),
        (64, 100),
        (100, 5),
        (256, 44),
    ):
        if not torch.equal(rows[offset : offset + count] @ weight.t(), reference[offset : offset + count]):
            return False
    return True


def _padded_matmul(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [M, in] -> [M, out] by one matmul over M rounded up to MATMUL_ROW_MULTIPLE rows."""
    num_rows, in_features = rows.shape
    padded_rows = -(-num_rows // MATMUL_ROW_MULTIPLE) * MATMUL_ROW_MULTIPLE
    rows = rows.contiguous()
    if padded_rows != num_rows:
        rows = torch.cat((rows, rows.new_zeros((padded_rows - num_rows, in_features))))
    return (rows @ weight.t())[:num_rows]


def invariant_linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """hidden [M, in] -> [M, out], each row's bits independent of the other rows.

    Where `rows_are_independent` measured it safe: prompt rows and beam requests' rows in one
    matmul padded to a multiple of 4 rows (the weights are read once per step), and each
    single-row decode request's row as a matrix-vector product (a greedy request alone is as fast
    as in transformers; a 4-row matmul costs about 2.5x a gemv here). Otherwise each row inside a
    fixed-shape item (see RowLayout)."""
    num_rows, in_features = hidden.shape
    layout = _ROW_LAYOUT.get()
    groups = layout.groups_for(num_rows) if layout is not None else _default_groups(num_rows, hidden.device)
    if rows_are_independent(
        in_features, weight.shape[0], weight.dtype, hidden.device.type, torch.get_num_threads()
    ):
        if groups.all_matmul:
            output = _padded_matmul(hidden, weight)
        else:
            output = hidden.new_empty((num_rows, weight.shape[0]))
            if groups.matmul_rows is not None:
                output[groups.matmul_rows] = _padded_matmul(hidden[groups.matmul_rows], weight)
            if groups.single_rows is not None:
                singles = hidden[groups.single_rows].unsqueeze(1)  # [n, 1, in]: one gemv each
                output[groups.single_rows] = torch.bmm(
                    singles, weight.t().expand(singles.shape[0], -1, -1)
                ).squeeze(1)
        return output if bias is None else output + bias
    padded = torch.cat((hidden, hidden.new_zeros((1, in_features))))  # row M: padding
    output = hidden.new_empty((num_rows + 1, weight.shape[0]))
    for rows_per_item, indices in groups.items:
        num_items = indices.numel() // rows_per_item
        items = padded[indices].view(num_items, rows_per_item, in_features)
        result = torch.bmm(items, weight.t().expand(num_items, -1, -1))  # [items, rows, out]
        output[indices] = result.view(num_items * rows_per_item, -1)
    output = output[:num_rows]
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
    """Query units of one shape that are computed together (one slice bounds the memory).

    Only the (unit, item) pairs a unit can see are computed: an item wholly past a unit's last
    position (causal, or padding up to the slice's longest context) would add exact zeros, so it
    is left out and its place in the tree sum holds zeros (same bits, less work)."""

    token_index: torch.Tensor  # [U, Q] index into the N new tokens; padding points at row N
    num_items: int  # I: items of the slice's longest unit
    pair_unit: torch.Tensor  # [V] the unit of each visible pair
    pair_slot: torch.Tensor  # [V] unit * I + item: the pair's leaf in the unit's tree sum
    pair_pages: torch.Tensor  # [V, pages per item] the item's pages (block 0 past the context)
    hidden_keys: torch.Tensor  # [V, Q, K] bool: key k of the pair's item is hidden from unit row q


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
    prompt_limit = MAX_PROMPT_TOKEN_PAGES // PROMPT_UNIT
    for size, limit in ((PROMPT_UNIT, prompt_limit), (1, MAX_DECODE_ITEMS)):
        group = units[size]
        begin = 0
        while begin < len(group):
            end, max_pages = begin, 0
            while end < len(group) and (end - begin + 1) * max(max_pages, len(group[end][2])) <= max(
                limit, len(group[end][2])
            ):
                max_pages = max(max_pages, len(group[end][2]))
                end += 1
            pages_per_item = PAGES_PER_ITEM if size == 1 else PROMPT_PAGES_PER_ITEM
            slices.append(
                _make_slice(
                    group[begin:end], size, max_pages, pages_per_item, num_tokens, tokens_per_block, device
                )
            )
            begin = end
    return InvariantLayout(tuple(slices))


def _make_slice(
    group: list[tuple[list[int], list[int], Sequence[int]]],
    size: int,
    max_pages: int,
    pages_per_item: int,
    num_tokens: int,
    tokens_per_block: int,
    device: torch.device | str,
) -> AttentionSlice:
    token_index = [indices + [num_tokens] * (size - len(indices)) for indices, _, _ in group]
    num_items = -(-max_pages // pages_per_item)
    keys_per_item = pages_per_item * tokens_per_block
    pair_unit: list[int] = []
    pair_slot: list[int] = []
    pair_pages: list[list[int]] = []
    pair_positions: list[list[int]] = []
    for unit, (_, positions, pages) in enumerate(group):
        # A padding row sits at position 0: it sees key 0, so its softmax stays finite; never read.
        padded_positions = positions + [0] * (size - len(positions))
        for item in range(positions[-1] // keys_per_item + 1):
            item_pages = list(pages[item * pages_per_item : (item + 1) * pages_per_item])
            pair_unit.append(unit)
            pair_slot.append(unit * num_items + item)
            pair_pages.append(item_pages + [0] * (pages_per_item - len(item_pages)))
            pair_positions.append([position - item * keys_per_item for position in padded_positions])
    key_offsets = torch.arange(keys_per_item, device=device)  # [K]
    positions_tensor = torch.tensor(pair_positions, dtype=torch.long, device=device)  # [V, Q]
    return AttentionSlice(
        token_index=torch.tensor(token_index, dtype=torch.long, device=device),
        num_items=num_items,
        pair_unit=torch.tensor(pair_unit, dtype=torch.long, device=device),
        pair_slot=torch.tensor(pair_slot, dtype=torch.long, device=device),
        pair_pages=torch.tensor(pair_pages, dtype=torch.long, device=device),
        hidden_keys=key_offsets[None, None, :] > positions_tensor[:, :, None],
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
    num_kv_heads = kv_layer.shape[3]
    group = num_heads // num_kv_heads
    softmax_dtype = torch.promote_types(query.dtype, torch.float32)
    padded_query = torch.cat((query, query.new_zeros((1, num_heads, head_dim))))  # row N: padding
    output = query.new_empty((num_tokens + 1, num_heads, head_dim))
    # The softmax denominator rides in the P @ V matmul as a column of ones (a fixed-shape sum),
    # except for bfloat16, whose output would round it: summed by tree_sum in float32 there.
    denominator_in_matmul = query.dtype != torch.bfloat16
    for part in layout.slices:
        num_units, unit_size = part.token_index.shape
        num_pairs, _, keys_per_item = part.hidden_keys.shape
        rows = group * unit_size
        unit_query = (padded_query[part.token_index] * scale).view(
            num_units, unit_size, num_kv_heads, group, head_dim
        )
        unit_query = unit_query.permute(0, 2, 3, 1, 4)  # [U, Hkv, G, Q, D]
        pair_query = unit_query[part.pair_unit].reshape(num_pairs * num_kv_heads, rows, head_dim)
        # An item's PAGES_PER_ITEM pages hold its keys_per_item keys in position order.
        item_shape = (num_pairs, keys_per_item, num_kv_heads, head_dim)
        keys = kv_layer[:, KEY][part.pair_pages].view(item_shape).permute(0, 2, 3, 1)  # [V, Hkv, D, K]
        values = kv_layer[:, VALUE][part.pair_pages].view(item_shape).permute(0, 2, 1, 3)  # [V, Hkv, K, D]
        if denominator_in_matmul:
            values = torch.cat((values, values.new_ones((*values.shape[:-1], 1))), dim=-1)
        keys = keys.reshape(num_pairs * num_kv_heads, head_dim, keys_per_item)
        values = values.reshape(num_pairs * num_kv_heads, keys_per_item, -1)
        scores = torch.bmm(pair_query, keys).view(num_pairs, num_kv_heads, group, unit_size, keys_per_item)
        scores = scores.to(softmax_dtype).masked_fill_(part.hidden_keys[:, None, None], float("-inf"))
        # The row maximum over a unit's pairs: exact in any order.
        item_max = scores.new_full(
            (num_units * part.num_items, num_kv_heads, group, unit_size), float("-inf")
        )
        item_max[part.pair_slot] = scores.amax(dim=-1)
        unit_max = item_max.view(num_units, part.num_items, num_kv_heads, group, unit_size).amax(dim=1)
        weights = scores.sub_(unit_max[part.pair_unit][..., None]).exp_()  # hidden keys exactly 0
        partial = torch.bmm(
            weights.to(query.dtype).view(num_pairs * num_kv_heads, rows, keys_per_item), values
        )
        leaves = partial.new_zeros(
            (num_units * part.num_items, num_kv_heads, group, unit_size, partial.shape[-1])
        )
        leaves[part.pair_slot] = partial.view(num_pairs, num_kv_heads, group, unit_size, -1)
        summed = tree_sum(leaves.view(num_units, part.num_items, num_kv_heads, group, unit_size, -1), dim=1)
        if denominator_in_matmul:
            numerator, denominator = summed[..., :head_dim], summed[..., head_dim:]
        else:
            weight_leaves = weights.new_zeros((num_units * part.num_items, num_kv_heads, group, unit_size))
            weight_leaves[part.pair_slot] = tree_sum(weights, dim=-1)
            weight_leaves = weight_leaves.view(num_units, part.num_items, num_kv_heads, group, unit_size)
            numerator, denominator = summed, tree_sum(weight_leaves, dim=1)[..., None]
        unit_output = (numerator.to(softmax_dtype) / denominator).to(query.dtype)  # [U, Hkv, G, Q, D]
        unit_output = unit_output.permute(0, 3, 1, 2, 4).reshape(num_units * unit_size, num_heads, head_dim)
        output[part.token_index.reshape(-1)] = unit_output
    return output[:num_tokens]
