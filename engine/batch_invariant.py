"""Batch-invariant linear layers: a token's numbers do not depend on what else is in the batch.

A plain `x @ W.T` on the CPU (MKL, oneDNN) picks its kernel from the number of rows: the same row
gives different float32 (and float64) bits alone, next to 2 others or next to 10; in float64 the
rows past a multiple of 4 take a remainder kernel. Measured on this build (torch 2.13, MKL
2024.2): one matmul over M rows, M a multiple of 4, gives every row the same bits at any position
next to any rows; a fixed-shape matmul does too, and a batched matmul of fixed-shape items gives
every item the same bits whatever the item count.

So every matmul here has a shape that depends on nothing but the token's role and its own request,
or is one that was measured not to care. `invariant_linear` takes the first of these paths that
was measured safe in the running process (once per shape, dtype and thread count):
- oneDNN (engine/onednn_calls.py): all rows in one inner-product call where any row count keeps
  rows apart (`onednn_rows_are_independent`; float32, and bfloat16 without AMX), else in calls of
  the row counts measured to agree (`onednn_call_sizes`; bfloat16 on AMX). On an AMD EPYC host
  (AVX-512) it is also the fastest: the 156M model's linear layers took 15-21 ms
  for 4 rows (fewer are padded to 4) against 31 ms for one row as MKL's matrix-vector product and
  40 ms for a group of 4 columns, and 27-35 ms against 131 ms for 16 rows. The engine
  packs the weights for it once at load (engine/packed_linear.py), keeping no dense copy.
- MKL (`rows_are_independent` and `columns_are_independent`): prompt rows through one matmul
  padded to a multiple of MATMUL_ROW_MULTIPLE rows and every decode row through
  `weight @ rows.T`, in whole groups of COLUMN_GROUP columns, two groups to a call where there
  are two. Where only the rows are, prompt rows and beam requests' rows share the padded matmul
  and a single-row decode request's row gets a matrix-vector product of its own. float64 takes
  these (oneDNN has no float64 inner product).
- Otherwise rows run as a batched matmul of fixed-shape [rows, in] x [in, out] items: prompt
  tokens (and a prompt's last row at the LM head) PROMPT_ROW_CHUNK to an item, in any grouping; a
  decoding request's W beams one item of W rows.
The last two group rows by a `RowLayout` that ModelRunner sets (`row_layout`) for the forward
pass in flight; without one, all rows are one padded matmul (or ROW_CHUNK-row items). The
attention's side is engine/invariant_attention.py.

The cost is padding (up to 3 zero rows or columns per matmul or oneDNN call); `bench invariance`
measures it with the attention's. See docs/engine.md, "Batch invariance".
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from engine.kernel_facts import kernel_check
from engine.onednn_calls import onednn_linear_if_independent, pad_rows

MATMUL_ROW_MULTIPLE = 4  # one plain matmul: rows padded to a multiple of 4 (see rows_are_independent)
ROW_CHUNK = 16  # rows per matmul item in invariant_linear when no RowLayout is set
PROMPT_ROW_CHUNK = 64  # prompt rows per matmul item (measured: as fast as one plain matmul at 512 rows)
COLUMN_GROUP = 4  # decode rows per `weight @ rows.T` kernel group (see columns_are_independent)
COLUMNS_PER_CALL = 2 * COLUMN_GROUP  # up to two groups per call (faster than two calls; same bits)


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
    # Where columns_are_independent: prompt rows in one matmul, every decode row (beam or single) in
    # column groups of COLUMN_GROUP (None: no such row)
    prompt_rows: torch.Tensor | None = None
    decode_rows: torch.Tensor | None = None


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
def row_layout(layout: RowLayout | None) -> Iterator[None]:
    """Linear layers called inside group their rows by `layout`; None for rows that are not the
    batch's tokens nor its sequences (one expert's tokens, engine/models/moe.py): no layout
    applies to them, so they take the default grouping, which is invariant too."""
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
    decode = sorted(row for rows in decode_items for row in rows)

    def index(rows: list[int]) -> torch.Tensor | None:
        return torch.tensor(rows, dtype=torch.long, device=device) if rows else None

    return RowGroups(
        num_rows,
        items,
        matmul_rows=index(matmul),
        all_matmul=len(matmul) == num_rows,
        single_rows=index(single),
        prompt_rows=index(sorted(prompt_rows)),
        decode_rows=index(decode),
    )


def _default_groups(num_rows: int, device: torch.device) -> RowGroups:
    num_chunks = -(-num_rows // ROW_CHUNK)
    indices = list(range(num_rows)) + [num_rows] * (num_chunks * ROW_CHUNK - num_rows)
    chunks = ((ROW_CHUNK, torch.tensor(indices, dtype=torch.long, device=device)),)
    return RowGroups(num_rows, chunks, matmul_rows=None, all_matmul=True, single_rows=None)


@kernel_check
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


@kernel_check
def columns_are_independent(
    in_features: int, out_features: int, dtype: torch.dtype, device_type: str, num_threads: int
) -> bool:
    """Does `weight @ rows.T` over exactly COLUMN_GROUP rows (as columns) give every row the same
    bits whichever of the COLUMN_GROUP places it takes and whatever rows are next to it?

    Measured on this build (MKL 2024.2, 1 and 2 threads, float32 and float64, every shape here):
    yes for 4 columns, and for 8 (two such groups); 1 to 3 columns, the remainder past a group
    and 12 or more columns take other kernels, so the check also compares a call of two groups
    with calls of one. 4 columns is MKL's skinny kernel, which streams
    the weight once: the whole 156M model's linear layers took 23 ms for 4 rows this way against
    29 ms for one row as a matrix-vector product and 57 ms for 4 rows as a 4-row matmul. Checked
    here once per shape, dtype and thread count in the process that runs."""
    if device_type != "cpu":
        return False
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    rows = torch.randn(3 * COLUMN_GROUP, in_features, generator=generator).to(dtype)
    for row in range(COLUMN_GROUP, 2 * COLUMN_GROUP):
        reference = weight @ rows[row : row + 1].expand(COLUMN_GROUP, -1).contiguous().t()
        for first in range(row - COLUMN_GROUP + 1, row + 1):
            place = row - first
            if not torch.equal((weight @ rows[first : first + COLUMN_GROUP].t())[:, place], reference[:, 0]):
                return False
    # A call of COLUMNS_PER_CALL columns must give what its groups give in calls of their own.
    calls = rows[:COLUMNS_PER_CALL].t()
    groups = [
        weight @ calls[:, first : first + COLUMN_GROUP] for first in range(0, COLUMNS_PER_CALL, COLUMN_GROUP)
    ]
    return torch.equal(weight @ calls, torch.cat(groups, dim=1))


def _column_matmul(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [n, in] -> [n, out] as `weight @ rows.T`, zero-padded to whole groups of COLUMN_GROUP,
    COLUMNS_PER_CALL columns per call (the last call may hold one group)."""
    padded = pad_rows(rows, COLUMN_GROUP)
    columns = [
        weight @ padded[first : first + COLUMNS_PER_CALL].t()
        for first in range(0, padded.shape[0], COLUMNS_PER_CALL)
    ]
    return torch.cat(columns, dim=1).t()[: rows.shape[0]]


def _padded_matmul(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [M, in] -> [M, out] by one matmul over M rounded up to MATMUL_ROW_MULTIPLE rows."""
    return (pad_rows(rows, MATMUL_ROW_MULTIPLE) @ weight.t())[: rows.shape[0]]


@kernel_check
def items_are_independent(
    rows_per_item: int,
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    device_type: str,
    num_threads: int,
) -> bool:
    """Does a batched matmul of fixed-shape [rows_per_item, in] x [in, out] items give every item the
    same bits whatever the item count?

    Measured: yes on AMD hosts for float32 and float64; on an Intel host with AVX-512 (MKL's
    AVX-512 kernels) float64 items differ between a call of 1 item and a call of 2 or more, while a
    separate matmul per item keeps them. Checked here once per shape, so such a host takes one call
    per item (`_item_matmul`). GPUs: no (cuBLAS picks its kernel by batch size)."""
    if device_type != "cpu":
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    items = torch.randn(24, rows_per_item, in_features, generator=generator).to(dtype)
    reference = torch.stack([item @ weight.t() for item in items])  # [24, rows, out]
    for first, count in ((0, 1), (0, 2), (3, 3), (1, 8), (0, 24)):
        batch = torch.bmm(items[first : first + count], weight.t().expand(count, -1, -1))
        if not torch.equal(batch, reference[first : first + count]):
            return False
    return True


def _item_matmul(items: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """items [n, rows, in] -> [n, rows, out]: one batched matmul where items_are_independent,
    else one matmul per item (every item then takes the same [rows, in] x [in, out] kernel)."""
    num_items, rows_per_item, in_features = items.shape
    shape = (
        rows_per_item,
        in_features,
        weight.shape[0],
        weight.dtype,
        items.device.type,
        torch.get_num_threads(),
    )
    if items_are_independent(*shape):
        return torch.bmm(items, weight.t().expand(num_items, -1, -1))
    return torch.stack([item @ weight.t() for item in items])


def _kernel_shape(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, torch.dtype, str, int]:
    """What the kernel checks are keyed by: in and out features, dtype, device type, threads."""
    return (weight.shape[1], weight.shape[0], weight.dtype, hidden.device.type, torch.get_num_threads())


def invariant_linear(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """hidden [M, in] -> [M, out], each row's bits independent of the other rows.

    Where a oneDNN check holds (engine/onednn_calls.py): every row in one oneDNN call, or in calls
    of measured row counts (`packed`, the weight in oneDNN's layout, or `weight` itself). Else, where both MKL
    checks pass: prompt rows in one matmul padded to a multiple of 4 rows, decode rows
    8 (or a last 4) to a `weight @ rows.T` call (4 columns are faster than a gemv for one row
    here, and a 4-row matmul costs about 2.5x a gemv). Where only `rows_are_independent`
    does: prompt and beam rows in the padded matmul, each single-row decode request's row as a
    matrix-vector product. Otherwise each row inside a fixed-shape item (see RowLayout)."""
    num_rows, in_features = hidden.shape
    shape = _kernel_shape(hidden, weight)
    output = onednn_linear_if_independent(hidden, weight if packed is None else packed, shape)
    if output is not None:
        return output if bias is None else output + bias
    layout = _ROW_LAYOUT.get()
    groups = layout.groups_for(num_rows) if layout is not None else _default_groups(num_rows, hidden.device)
    if rows_are_independent(*shape) and groups.decode_rows is not None and columns_are_independent(*shape):
        output = hidden.new_empty((num_rows, weight.shape[0]))
        if groups.prompt_rows is not None:
            output[groups.prompt_rows] = _padded_matmul(hidden[groups.prompt_rows], weight)
        output[groups.decode_rows] = _column_matmul(hidden[groups.decode_rows], weight)
        return output if bias is None else output + bias
    if rows_are_independent(*shape):
        if groups.all_matmul:
            output = _padded_matmul(hidden, weight)
        else:
            output = hidden.new_empty((num_rows, weight.shape[0]))
            if groups.matmul_rows is not None:
                output[groups.matmul_rows] = _padded_matmul(hidden[groups.matmul_rows], weight)
            if groups.single_rows is not None:
                singles = hidden[groups.single_rows].unsqueeze(1)  # [n, 1, in]: one gemv each
                output[groups.single_rows] = _item_matmul(singles, weight).squeeze(1)
        return output if bias is None else output + bias
    padded = torch.cat((hidden, hidden.new_zeros((1, in_features))))  # row M: padding
    output = hidden.new_empty((num_rows + 1, weight.shape[0]))
    for rows_per_item, indices in groups.items:
        num_items = indices.numel() // rows_per_item
        items = padded[indices].view(num_items, rows_per_item, in_features)
        output[indices] = _item_matmul(items, weight).view(num_items * rows_per_item, -1)
    output = output[:num_rows]
    return output if bias is None else output + bias


class RowChunkedLinear(nn.Linear):
    """nn.Linear whose rows do not depend on the other rows of the batch (same parameters).

    It keeps the weight dense (oneDNN's path reorders it on each call); the engine replaces the
    layers that take oneDNN's path by engine/packed_linear.py's PackedLinear at load, which
    hold the weight packed instead."""

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
