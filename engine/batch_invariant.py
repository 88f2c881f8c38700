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
- `invariant_attention`, prompt tokens: in units of PROMPT_UNIT aligned to positions; unit k
  holds the queries of positions [64 k, 64 k + 64) (those not in this pass are padding rows) and
  reads keys [0, 64 k + 64) from one gathered copy of its sequence's pages. Its two matmuls,
  scores [Hkv, 64 G, D] x [Hkv, D, 64 k + 64], a softmax over each row, and P @ V
  [Hkv, 64 G, 64 k + 64] x [Hkv, 64 k + 64, D], have shapes and
  strides that follow from k alone, so a prompt token computed whole, in a chunk that starts on
  or off a unit boundary, after a reused prefix or next to other prompts gives the same bits.
  Keys past a row's position are masked to -inf before the row maximum (exact in any order).
- `invariant_attention`, decode tokens: a decode token alone (G rows per kv head) against items of
  PAGES_PER_ITEM pages, each item's pages copied once in their page layout; scores [G, D] x
  [D, K] and P @ V [G, K] x [K, D] are fixed-shape items of one batched matmul per kv head
  (strides that are constants). Items are summed by `tree_sum`, the softmax denominators too
  (item by item, then over items): a pairwise tree with a fixed leaf for each item, so items
  past a token's position (or padding up to the batch's longest context) only ever add exact
  zeros. torch's own `sum` is not safe here: measured, summing a middle axis whose inner size
  is under 16 or so changes bits with the axis length and the row count.

The cost is padding (up to 3 zero rows per linear matmul, up to 63 query rows per prompt
sequence and pass) and smaller matmuls for decode attention; `bench invariance` measures it. See docs/engine.md, "Batch invariance".

Dimensions: N new tokens, U query units, Q tokens per unit, P pages, T tokens per page, H query
heads, Hkv kv heads, G = H / Hkv, D head dim.
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
PROMPT_UNIT = 64  # prompt queries per attention unit, aligned to positions (unit k: [64 k, 64 k + 64))
PAGES_PER_ITEM = 4  # keys of one decode token's attention item: 4 pages (128 keys at T = 32)
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
    """Decode tokens that are computed together (one slice bounds the memory).

    Only the (unit, item) pairs a unit can see are computed: an item wholly past a unit's last
    position (padding up to the slice's longest context) would add exact zeros, so it is left out
    and its place in the tree sum holds zeros (same bits, less work)."""

    token_index: torch.Tensor  # [U, Q] index into the N new tokens; padding points at row N
    num_items: int  # I: items of the slice's longest unit
    pair_unit: torch.Tensor  # [V] the unit of each visible pair
    pair_slot: torch.Tensor  # [V] unit * I + item: the pair's leaf in the unit's tree sum
    pair_pages: torch.Tensor  # [V, pages per item] the item's pages (block 0 past the context)
    hidden_keys: torch.Tensor  # [V, Q, K] bool: key k of the pair's item is hidden from unit row q
    # The pairs of one request's beams that read the same item at the same position share one copy
    # of its pages and one matmul of R G rows: per R, the member pairs [items, R] (R is a function
    # of the request's own beams, never of the batch).
    shared: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True)
class PromptSequence:
    """One sequence's prompt tokens in a forward pass, in units aligned to positions: unit k holds
    the queries of positions [k * PROMPT_UNIT, (k + 1) * PROMPT_UNIT) and reads keys
    [0, (k + 1) * PROMPT_UNIT). Every shape a prompt token meets is a function of its position."""

    pages: torch.Tensor  # [P] pages of keys [0, the last unit's end) (block 0 past the sequence's own)
    unit_ends: tuple[int, ...]  # (k + 1) * PROMPT_UNIT for each unit, in order
    token_index: torch.Tensor  # [units, PROMPT_UNIT] new-token row of each position; N if not new


@dataclass(frozen=True)
class InvariantLayout:
    slices: tuple[AttentionSlice, ...]  # decode tokens
    prompts: tuple[PromptSequence, ...] = ()


def prepare_invariant_layout(
    seqs: Sequence[tuple[Sequence[int], int, int]],
    is_decode: Sequence[bool],
    tokens_per_block: int,
    device: torch.device | str,
    beam_group_sizes: Sequence[int] | None = None,
) -> InvariantLayout:
    """seqs: (block_ids, num_cached_tokens, num_new_tokens) in batch order, as prepare_attention;
    beam_group_sizes: per decode sequence the W of its request, whose W beams are consecutive
    (None: each decode sequence is a request of its own)."""
    num_tokens = sum(num_new for _, _, num_new in seqs)
    # Per request, (token index, position, block ids) of each decoding beam
    decode_groups: list[list[tuple[int, int, Sequence[int]]]] = []
    prompts: list[PromptSequence] = []
    start, group_end = 0, 0
    for index, ((block_ids, num_cached, num_new), decode) in enumerate(zip(seqs, is_decode, strict=True)):
        if decode:
            if num_new != 1:
                raise ValueError(f"a decode sequence feeds one token, got {num_new}")
            if index >= group_end:
                decode_groups.append([])
                group_end = index + (1 if beam_group_sizes is None else max(1, beam_group_sizes[index]))
            decode_groups[-1].append((start, num_cached, block_ids[: num_cached // tokens_per_block + 1]))
        else:
            prompts.append(
                _prompt_sequence(block_ids, num_cached, num_new, start, num_tokens, tokens_per_block, device)
            )
        start += num_new
    # Slices bound the memory; a request's beams always stay in one slice.
    slices: list[AttentionSlice] = []
    current: list[list[tuple[int, int, Sequence[int]]]] = []
    num_units, max_pages = 0, 0
    for group in decode_groups:
        pages = max(len(beam[2]) for beam in group)
        if current and (num_units + len(group)) * max(max_pages, pages) > MAX_DECODE_ITEMS:
            slices.append(_make_slice(current, max_pages, tokens_per_block, device))
            current, num_units, max_pages = [], 0, 0
        current.append(group)
        num_units, max_pages = num_units + len(group), max(max_pages, pages)
    if current:
        slices.append(_make_slice(current, max_pages, tokens_per_block, device))
    return InvariantLayout(tuple(slices), tuple(prompts))


def _prompt_sequence(
    block_ids: Sequence[int],
    num_cached: int,
    num_new: int,
    start: int,
    num_tokens: int,
    tokens_per_block: int,
    device: torch.device | str,
) -> PromptSequence:
    first_unit, last_unit = num_cached // PROMPT_UNIT, (num_cached + num_new - 1) // PROMPT_UNIT
    unit_ends = tuple((unit + 1) * PROMPT_UNIT for unit in range(first_unit, last_unit + 1))
    # Keys up to the last unit's end; the pages past the sequence's own hold keys that only
    # positions past its new tokens could see (masked for every real row).
    num_pages = -(-unit_ends[-1] // tokens_per_block)
    pages = list(block_ids[:num_pages]) + [0] * max(0, num_pages - len(block_ids))
    token_index = [
        [
            start + position - num_cached if num_cached <= position < num_cached + num_new else num_tokens
            for position in range(end - PROMPT_UNIT, end)
        ]
        for end in unit_ends
    ]
    return PromptSequence(
        pages=torch.tensor(pages, dtype=torch.long, device=device),
        unit_ends=unit_ends,
        token_index=torch.tensor(token_index, dtype=torch.long, device=device),
    )


def _make_slice(
    groups: list[list[tuple[int, int, Sequence[int]]]],
    max_pages: int,
    tokens_per_block: int,
    device: torch.device | str,
) -> AttentionSlice:
    num_items = -(-max_pages // PAGES_PER_ITEM)
    keys_per_item = PAGES_PER_ITEM * tokens_per_block
    token_index: list[list[int]] = []
    pair_unit: list[int] = []
    pair_slot: list[int] = []
    pair_pages: list[list[int]] = []
    pair_positions: list[list[int]] = []
    by_size: dict[int, list[list[int]]] = {}
    for group in groups:
        # (item pages, position) -> the pairs of this request's beams that read it
        readers: dict[tuple[tuple[int, ...], int], list[int]] = {}
        for token, position, pages in group:
            unit = len(token_index)
            token_index.append([token])
            for item in range(position // keys_per_item + 1):
                item_pages = list(pages[item * PAGES_PER_ITEM : (item + 1) * PAGES_PER_ITEM])
                item_pages += [0] * (PAGES_PER_ITEM - len(item_pages))
                readers.setdefault((tuple(item_pages), position), []).append(len(pair_unit))
                pair_unit.append(unit)
                pair_slot.append(unit * num_items + item)
                pair_pages.append(item_pages)
                pair_positions.append([position - item * keys_per_item])
        for members in readers.values():
            by_size.setdefault(len(members), []).append(members)
    key_offsets = torch.arange(keys_per_item, device=device)  # [K]
    positions_tensor = torch.tensor(pair_positions, dtype=torch.long, device=device)  # [V, Q]
    return AttentionSlice(
        token_index=torch.tensor(token_index, dtype=torch.long, device=device),
        num_items=num_items,
        pair_unit=torch.tensor(pair_unit, dtype=torch.long, device=device),
        pair_slot=torch.tensor(pair_slot, dtype=torch.long, device=device),
        pair_pages=torch.tensor(pair_pages, dtype=torch.long, device=device),
        hidden_keys=key_offsets[None, None, :] > positions_tensor[:, :, None],
        shared=tuple(
            torch.tensor(members, dtype=torch.long, device=device) for _, members in sorted(by_size.items())
        ),
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
    padded_query = torch.cat((query, query.new_zeros((1, num_heads, head_dim))))  # row N: padding
    output = query.new_empty((num_tokens + 1, num_heads, head_dim))
    for part in layout.slices:
        _decode_attention(padded_query, kv_layer, part, scale, output)
    for prompt in layout.prompts:
        _prompt_attention(padded_query, kv_layer, prompt, scale, output)
    return output[:num_tokens]


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _gather_pages(kv_layer: torch.Tensor, kind: int, pages: torch.Tensor) -> torch.Tensor:
    """kv_layer [blocks, 2, T, Hkv, D], pages [...] -> the pages' keys (kind KEY) or values
    [..., T, Hkv, D], copied. A page is one row of kv_layer[:, kind] seen as [blocks, T Hkv D];
    index_select copies whole rows, measured about a fifth faster than advanced indexing."""
    rows = kv_layer[:, kind].flatten(1).index_select(0, pages.reshape(-1))
    return rows.view(*pages.shape, *kv_layer.shape[2:])


def _prompt_attention(
    padded_query: torch.Tensor,
    kv_layer: torch.Tensor,
    prompt: PromptSequence,
    scale: float,
    output: torch.Tensor,
) -> None:
    """Unit by unit: scores [Hkv, Q G, end], softmax, and P @ V [Hkv, Q G, end] x [Hkv, end, D], where
    end = (k + 1) * Q for unit k. The keys and values are one gathered copy of the sequence's
    pages whose strides do not depend on its length, so a unit's matmuls are the same calls
    whatever else is in the pass (an earlier chunk, a reused prefix, other prompts)."""
    num_heads, head_dim = padded_query.shape[1:]
    num_kv_heads = kv_layer.shape[3]
    group = num_heads // num_kv_heads
    dtype, softmax_dtype = padded_query.dtype, _softmax_dtype(padded_query.dtype)
    keys = _gather_pages(kv_layer, KEY, prompt.pages).flatten(0, 1)  # [P T, Hkv, D] in position order
    values = _gather_pages(kv_layer, VALUE, prompt.pages).flatten(0, 1)
    offsets = torch.arange(PROMPT_UNIT, device=padded_query.device)
    causal = (offsets[None, :] > offsets[:, None])[:, None, :]  # [Q, 1, Q]: key past the query's position
    for end, token_index in zip(prompt.unit_ends, prompt.token_index, strict=True):
        unit_query = (padded_query[token_index] * scale).view(PROMPT_UNIT, num_kv_heads, group, head_dim)
        unit_query = unit_query.transpose(0, 1).reshape(num_kv_heads, PROMPT_UNIT * group, head_dim)
        scores = torch.bmm(unit_query, keys[:end].permute(1, 2, 0))  # [Hkv, Q G, end]
        scores.view(num_kv_heads, PROMPT_UNIT, group, end)[..., end - PROMPT_UNIT :].masked_fill_(
            causal, float("-inf")
        )
        # One fused pass per row (maximum, exp, sum, scale); hidden keys weigh exactly 0.
        probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(dtype)
        unit_output = torch.bmm(probs, values[:end].transpose(0, 1))  # [Hkv, Q G, D]
        output[token_index] = (
            unit_output.view(num_kv_heads, PROMPT_UNIT, group, head_dim)
            .transpose(0, 1)
            .reshape(PROMPT_UNIT, num_heads, head_dim)
        )


def _decode_attention(
    padded_query: torch.Tensor,
    kv_layer: torch.Tensor,
    part: AttentionSlice,
    scale: float,
    output: torch.Tensor,
) -> None:
    """Decode tokens against fixed items of PAGES_PER_ITEM pages, summed by tree_sum.

    Each item's pages are copied once, in their page layout [K, Hkv, D]; one batched matmul per kv
    head reads a head's keys and values from that copy in place (its strides are constants), so
    neither the keys' transpose nor the values' costs another copy. The softmax denominator
    is a tree sum of the weights, item by item, then over items."""
    num_heads, head_dim = padded_query.shape[1:]
    num_kv_heads = kv_layer.shape[3]
    group = num_heads // num_kv_heads
    dtype, softmax_dtype = padded_query.dtype, _softmax_dtype(padded_query.dtype)
    num_units = part.token_index.shape[0]
    num_pairs, _, keys_per_item = part.hidden_keys.shape
    unit_query = (padded_query[part.token_index[:, 0]] * scale).view(num_units, num_kv_heads, group, head_dim)
    pair_query = unit_query[part.pair_unit]  # [V, Hkv, G, D]
    # Per bucket of R pairs sharing an item: its pages copied once [n, K, Hkv, D], position order.
    buckets = []
    scores = padded_query.new_empty((num_kv_heads, num_pairs, group, keys_per_item))
    for members in part.shared:
        num_shared, size = members.shape
        pages = part.pair_pages[members[:, 0]]
        item_shape = (num_shared, keys_per_item, num_kv_heads, head_dim)
        keys = _gather_pages(kv_layer, KEY, pages).view(item_shape)
        values = _gather_pages(kv_layer, VALUE, pages).view(item_shape)
        rows = (
            pair_query[members]
            .permute(2, 0, 1, 3, 4)
            .reshape(num_kv_heads, num_shared, size * group, head_dim)
        )
        shared_scores = padded_query.new_empty((num_kv_heads, num_shared, size * group, keys_per_item))
        for head in range(num_kv_heads):
            torch.bmm(rows[head], keys[:, :, head].transpose(1, 2), out=shared_scores[head])
        scores[:, members.reshape(-1)] = shared_scores.view(
            num_kv_heads, num_shared * size, group, keys_per_item
        )
        buckets.append((members, values))
    scores = scores.to(softmax_dtype).masked_fill_(part.hidden_keys[None, :, :, :], float("-inf"))
    # The row maximum over a token's pairs: exact in any order.
    item_max = scores.new_full((num_kv_heads, num_units * part.num_items, group), float("-inf"))
    item_max[:, part.pair_slot] = scores.amax(dim=-1)
    unit_max = item_max.view(num_kv_heads, num_units, part.num_items, group).amax(dim=2)
    weights = scores.sub_(unit_max[:, part.pair_unit, :, None]).exp_()  # hidden keys exactly 0
    cast_weights = weights.to(dtype)
    partial = padded_query.new_empty((num_kv_heads, num_pairs, group, head_dim))
    for members, values in buckets:
        num_shared, size = members.shape
        shared_weights = cast_weights[:, members.reshape(-1)].view(
            num_kv_heads, num_shared, size * group, keys_per_item
        )
        shared_partial = padded_query.new_empty((num_kv_heads, num_shared, size * group, head_dim))
        for head in range(num_kv_heads):
            torch.bmm(shared_weights[head], values[:, :, head], out=shared_partial[head])
        partial[:, members.reshape(-1)] = shared_partial.view(
            num_kv_heads, num_shared * size, group, head_dim
        )
    leaves = partial.new_zeros((num_kv_heads, num_units * part.num_items, group, head_dim))
    leaves[:, part.pair_slot] = partial
    numerator = tree_sum(leaves.view(num_kv_heads, num_units, part.num_items, group, head_dim), dim=2)
    weight_leaves = weights.new_zeros((num_kv_heads, num_units * part.num_items, group))
    weight_leaves[:, part.pair_slot] = tree_sum(weights, dim=-1)
    denominator = tree_sum(weight_leaves.view(num_kv_heads, num_units, part.num_items, group), dim=2)
    unit_output = (numerator.to(softmax_dtype) / denominator[..., None]).to(dtype)  # [Hkv, U, G, D]
    output[part.token_index[:, 0]] = unit_output.transpose(0, 1).reshape(num_units, num_heads, head_dim)
