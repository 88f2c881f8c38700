"""oneDNN inner-product calls that keep a row's bits apart from the other rows, and their checks.

engine/batch_invariant.py's first path: a linear layer's rows go through oneDNN's inner product
(`torch.ops.mkldnn._linear_pointwise`) on a weight packed once in oneDNN's blocked layout, in
calls whose row counts were measured, in the running process (once per shape, dtype and thread
count), to give every row the same bits wherever it sits and whatever rows are next to it:
- `onednn_rows_are_independent`: any row count M >= 2 (float32 and bfloat16 on AVX-512 without
  AMX; float32 on the AMX host): all rows in one call, zero-padded to ONEDNN_MIN_ROWS.
- `onednn_call_sizes`: where that fails (bfloat16 on AMX: oneDNN picks kernel and blocking from
  M), the set of row counts, among ONEDNN_CALL_SIZES, whose calls all give a row the bits of a
  ONEDNN_CHUNK_ROWS-row call. Rows are then split into calls of sizes from the set: as many
  ONEDNN_CHUNK_ROWS-row calls as fit, the rest in one call of the smallest member that holds it
  (zero-padded). Measured on the AMX host (Xeon, oneDNN 3.12, 1 and 2 threads, every linear
  shape of SmolLM2-135M, 512-row banks at random positions): every M from 1 to 32 gives a row one
  set of bits and every M from 33 to 256 another (1536 -> 576 splits the latter further), so a
  beam-4 decode step's 4 rows take one 4-row call instead of a zero-padded 32-row one.

How many outputs a check compares matters in bfloat16: when two kernels reduce in different
orders, the float32 sums differ in their last bits but the bfloat16 outputs differ only where the
rounding falls the other way, 1 output in 10,000 to 60,000 on the AMX host (32 against 64 rows,
the model's shapes). A check over a few hundred rows of a narrow layer can miss that (the any-M
check of 300 rows passed the 576 -> 960 shape, whose rows differ between M = 32 and 33), so the
checks compare at least `_outputs_to_compare(dtype)` outputs per row count.

Dimensions: M rows, in and out features.
"""

from __future__ import annotations

import torch

from engine.kernel_facts import kernel_check

ONEDNN_MIN_ROWS = 4  # fewer rows are zero-padded: one row takes a matrix-vector kernel (other bits),
# and 2 rows took 24-28 ms where 4 took 15-21 (the 156M model's linear layers)
ONEDNN_PACK_ROWS = 16  # the row count oneDNN's weight layout is chosen for (any gives the same bits)
ONEDNN_CHUNK_ROWS = 32  # the largest oneDNN call where only some row counts keep rows apart (AMX bf16)
# Row counts a call may take there, ascending, the last the reference: a 4-row call cost 60-80% of
# a 32-row one (bfloat16, 1 thread: 1536 -> 576 43 against 72 us, 576 -> 3072 149 against 184, the
# 576 -> 49152 head 2109 against 2678); 1 to 3 rows cost what 4 do, 24 what 32 do.
ONEDNN_CALL_SIZES = (4, 8, 16, ONEDNN_CHUNK_ROWS)
ANY_ROW_COUNTS = (256, 100, 64, 33, 16, 13, 8, 5, 4, 3, 2)  # the any-M check's, fewest calls first


def onednn_inner_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [M, in] -> [M, out] by one call of oneDNN's inner product; `weight` is [out, in],
    dense or packed by pack_onednn_weight."""
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), weight, None, "none", [], "")


def pack_onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout, which spares each call a reorder."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ONEDNN_PACK_ROWS)


def _outputs_to_compare(dtype: torch.dtype) -> int:
    """Outputs a check compares per row count: 2^20 in 16-bit floats (a kernel change flips 1 in
    10,000 to 60,000 of them: ~17 or more expected flips), 2^14 otherwise (float32 sums in another
    order differ in most outputs' last bits)."""
    return 1 << 20 if dtype in (torch.bfloat16, torch.float16) else 1 << 14


def _rows_to_compare(out_features: int, dtype: torch.dtype) -> int:
    """Rows whose outputs a check compares per row count (see _outputs_to_compare)."""
    return -(-_outputs_to_compare(dtype) // out_features)


def _window(num_rows: int, offset: int, size: int, rows_to_compare: int, min_calls: int) -> slice:
    """Rows from `offset` in whole calls of `size`: at least min_calls calls and rows_to_compare
    rows where the bank [num_rows] holds them."""
    num_calls = min((num_rows - offset) // size, max(min_calls, -(-rows_to_compare // size)))
    return slice(offset, offset + num_calls * size)


def _in_calls_of(rows: torch.Tensor, weight: torch.Tensor, size: int) -> torch.Tensor:
    """rows [n * size, in] -> [n * size, out] in calls of exactly `size` rows."""
    return torch.cat(
        [onednn_inner_product(rows[first : first + size], weight) for first in range(0, rows.shape[0], size)]
    )


@kernel_check
def onednn_rows_are_independent(
    in_features: int, out_features: int, dtype: torch.dtype, device_type: str, num_threads: int
) -> bool:
    """Does oneDNN's inner product over M >= 2 rows give every row the same bits for every M,
    wherever the row sits, with the weight packed (pack_onednn_weight) or dense?

    Measured on this build (oneDNN 3.12, AVX-512): yes for float32 and bfloat16 at every M from 2
    to 4096, 1 to 3 threads, every shape of the models here (LM heads included); the bits do not
    change with the thread count. M = 1 differs with the dense weight (a matrix-vector kernel; with
    the packed one it does not), hence the padding; float64 and float16 have no inner product
    there. Not on the AMX host in bfloat16 (see the module's docstring). Checked here once per
    shape, dtype and thread count in the process that runs; GPUs take the other paths."""
    if device_type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(2)
    rows_to_compare = _rows_to_compare(out_features, dtype)
    num_rows = max(300, rows_to_compare) + max(ANY_ROW_COUNTS)  # a call of each count past its offset
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    rows = torch.randn(num_rows, in_features, generator=generator).to(dtype)
    try:
        packed = pack_onednn_weight(weight)
        reference = onednn_inner_product(rows, packed)  # [num_rows, out]: one call of every row
        if not torch.equal(onednn_inner_product(rows[:300], weight), reference[:300]):
            return False
    except RuntimeError:  # no oneDNN inner product for this dtype or shape
        return False
    for count in ANY_ROW_COUNTS:
        window = _window(num_rows, count // 2 + 1, count, rows_to_compare, 1)  # other places, neighbours
        if not torch.equal(_in_calls_of(rows[window], packed, count), reference[window]):
            return False
    return True


@kernel_check
def onednn_call_sizes(
    in_features: int, out_features: int, dtype: torch.dtype, device_type: str, num_threads: int
) -> tuple[int, ...]:
    """The row counts among ONEDNN_CALL_SIZES whose oneDNN calls give every row the bits of a
    ONEDNN_CHUNK_ROWS-row call, wherever it sits in the call and whatever rows are next to it,
    weight packed or dense; () where not even calls of ONEDNN_CHUNK_ROWS rows do.

    The fallback where `onednn_rows_are_independent` fails (see the module's docstring). Each
    member is compared with the reference over a random bank in calls that start at another
    offset (so every row takes another position and other neighbours), and once with the dense
    weight; a member that differs anywhere is left out, so any two members agree. Checked here
    once per shape, dtype and thread count."""
    if device_type != "cpu" or not torch.backends.mkldnn.is_available():
        return ()
    largest = ONEDNN_CALL_SIZES[-1]
    generator = torch.Generator().manual_seed(4)
    rows_to_compare = _rows_to_compare(out_features, dtype)
    num_rows = max(8, -(-rows_to_compare // largest) + 1) * largest
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    rows = torch.randn(num_rows + largest, in_features, generator=generator).to(dtype)
    try:
        packed = pack_onednn_weight(weight)
        reference = _in_calls_of(rows[:num_rows], packed, largest)  # [num_rows, out]
    except RuntimeError:  # no oneDNN inner product for this dtype or shape
        return ()
    sizes = []
    for size in ONEDNN_CALL_SIZES:
        offset = size // 2 + 1 if size < largest else 13  # other places and neighbours than the reference's
        window = _window(num_rows, offset, size, rows_to_compare, 2)
        dense = onednn_inner_product(rows[offset : offset + size], weight)
        if torch.equal(_in_calls_of(rows[window], packed, size), reference[window]) and torch.equal(
            dense, reference[offset : offset + size]
        ):
            sizes.append(size)
        elif size == largest:
            return ()
    return tuple(sizes)


def onednn_chunked(rows: torch.Tensor, weight: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """rows [M, in] -> [M, out] by oneDNN calls of row counts from `sizes` (ascending, from
    onednn_call_sizes): the fewest calls, then the least padding. M = 70, sizes (4, 8, 16, 32):

        rows  0 ........ 31 | 32 ....... 63 | 64 .. 69 + 2 zero rows
              call of 32      call of 32      call of 8
    """
    num_rows = rows.shape[0]
    largest = sizes[-1]
    num_full = num_rows // largest
    rest = num_rows - num_full * largest
    rows = rows.contiguous()
    calls = [
        onednn_inner_product(rows[first : first + largest], weight)
        for first in range(0, num_full * largest, largest)
    ]
    if rest:
        size = next(size for size in sizes if size >= rest)
        calls.append(onednn_inner_product(pad_rows(rows[num_full * largest :], size), weight))
    return (calls[0] if len(calls) == 1 else torch.cat(calls))[:num_rows]  # no copy of one call


def onednn_linear_if_independent(
    hidden: torch.Tensor, weight: torch.Tensor, shape: tuple[int, int, torch.dtype, str, int]
) -> torch.Tensor | None:
    """hidden [M, in] -> [M, out] through oneDNN where one of its checks holds for `shape` (in and
    out features, dtype, device type, threads), else None. `weight`: [out, in], dense or packed."""
    if onednn_rows_are_independent(*shape):
        num_rows = hidden.shape[0]
        if num_rows >= ONEDNN_MIN_ROWS:
            return onednn_inner_product(hidden, weight)
        return onednn_inner_product(pad_rows(hidden, ONEDNN_MIN_ROWS), weight)[:num_rows]
    sizes = onednn_call_sizes(*shape)
    if sizes:
        return onednn_chunked(hidden, weight, sizes)
    return None


def pad_rows(rows: torch.Tensor, multiple: int) -> torch.Tensor:
    """rows [n, in], contiguous, with zero rows appended up to a multiple of `multiple`."""
    num_rows, in_features = rows.shape
    padded_rows = -(-num_rows // multiple) * multiple
    rows = rows.contiguous()
    if padded_rows == num_rows:
        return rows
    return torch.cat((rows, rows.new_zeros((padded_rows - num_rows, in_features))))
