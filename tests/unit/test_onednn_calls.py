"""oneDNN call-size sets (engine/onednn_calls.py): which row counts a check admits, and how rows are
split into calls of them.

The checks are run against fake kernels whose bits depend on the row count, the row's position or
the weight's layout, the ways AMX's bfloat16 kernels were seen to (or could) differ, so that a
check that stopped looking would fail here; the real kernels' verdicts are in
tests/unit/test_batch_invariance.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine import onednn_calls
from engine.onednn_calls import ONEDNN_CALL_SIZES, ONEDNN_CHUNK_ROWS, onednn_chunked

Kernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _nudged(output: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """output with the last bit of the elements at `where` changed (their bit patterns plus one)."""
    bits = output.view(torch.int16 if output.dtype == torch.bfloat16 else torch.int32)
    return torch.where(where, bits + 1, bits).view(output.dtype)


def _call_sizes_with(kernel: Kernel, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> tuple[int, ...]:
    """onednn_call_sizes, uncached, over `kernel` (rows [M, in], weight [out, in] -> [M, out]) as
    oneDNN's inner product; the packed weight is a copy, so a kernel can tell the two layouts apart."""
    packed_pointers: set[int] = set()

    def pack(weight: torch.Tensor) -> torch.Tensor:
        packed = weight.detach().clone()
        packed_pointers.add(packed.data_ptr())
        return packed

    def inner_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return kernel(rows, weight) if weight.data_ptr() in packed_pointers else kernel_dense(rows, weight)

    kernel_dense = getattr(kernel, "dense", kernel)
    monkeypatch.setattr(onednn_calls, "pack_onednn_weight", pack)
    monkeypatch.setattr(onednn_calls, "onednn_inner_product", inner_product)
    return onednn_calls.onednn_call_sizes.__wrapped__(64, 96, dtype, "cpu", 1)  # type: ignore[attr-defined]


def _exact(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Every row's bits whatever the call: bfloat16 products summed exactly in float64 (16-bit
    products of values this size need far fewer than 53 bits), then rounded once."""
    return (rows.double() @ weight.double().t()).to(rows.dtype)


def test_a_kernel_that_keeps_rows_apart_admits_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _call_sizes_with(_exact, monkeypatch, torch.bfloat16) == ONEDNN_CALL_SIZES


def test_a_size_whose_bits_differ_rarely_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """8-row calls change about 1 bfloat16 output in 24,000 (the AMX host's kernels change 1 in
    10,000 to 60,000 between row-count classes; which outputs follows from the row's values, so
    each row keeps its bits within the size): the check compares enough outputs to see it."""

    def kernel(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        output = _exact(rows, weight)
        if rows.shape[0] != 8:
            return output
        row_keys = rows.view(torch.int16).int().sum(dim=1, keepdim=True)  # [M, 1]
        columns = torch.arange(output.shape[1])  # [out]
        return _nudged(output, ((row_keys * 97 + columns) * 40503) & 0xFFFF < 3)

    sizes = _call_sizes_with(kernel, monkeypatch, torch.bfloat16)
    assert sizes == tuple(size for size in ONEDNN_CALL_SIZES if size != 8)


def test_a_largest_size_whose_bits_follow_the_position_admits_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Row 5 of every ONEDNN_CHUNK_ROWS-row call takes other bits: no call size keeps rows apart."""

    def kernel(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        output = _exact(rows, weight)
        if rows.shape[0] != ONEDNN_CHUNK_ROWS:
            return output
        position = torch.zeros_like(output, dtype=torch.bool)
        position[5] = True
        return _nudged(output, position)

    assert _call_sizes_with(kernel, monkeypatch, torch.bfloat16) == ()


def test_a_size_whose_bits_follow_the_neighbours_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16-row call whose first row's bits depend on the next row's sign."""

    def kernel(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        output = _exact(rows, weight)
        if rows.shape[0] != 16 or rows[1, 0] <= 0:
            return output
        first = torch.zeros_like(output, dtype=torch.bool)
        first[0] = True
        return _nudged(output, first)

    assert 16 not in _call_sizes_with(kernel, monkeypatch, torch.bfloat16)


def test_a_size_whose_dense_weight_gives_other_bits_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """4-row calls on the dense weight take another kernel (as one row does in oneDNN)."""

    def dense(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        output = _exact(rows, weight)
        return _nudged(output, torch.ones_like(output, dtype=torch.bool)) if rows.shape[0] == 4 else output

    def kernel(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _exact(rows, weight)

    kernel.dense = dense  # type: ignore[attr-defined]
    assert _call_sizes_with(kernel, monkeypatch, torch.bfloat16) == (8, 16, 32)


@pytest.mark.parametrize(
    ("num_rows", "sizes", "calls"),
    [
        (1, (4, 8, 16, 32), [4]),
        (4, (4, 8, 16, 32), [4]),
        (5, (4, 8, 16, 32), [8]),
        (32, (4, 8, 16, 32), [32]),
        (33, (4, 8, 16, 32), [32, 4]),
        (70, (4, 8, 16, 32), [32, 32, 8]),
        (70, (4, 16, 32), [32, 32, 16]),
        (70, (32,), [32, 32, 32]),
    ],
)
def test_rows_take_the_fewest_calls_then_the_least_padding(
    num_rows: int, sizes: tuple[int, ...], calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calls onednn_chunked makes, and that every row gets its own row's product back."""
    made: list[int] = []

    def inner_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        made.append(rows.shape[0])
        return _exact(rows, weight)

    monkeypatch.setattr(onednn_calls, "onednn_inner_product", inner_product)
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(12, 8, generator=generator).bfloat16()
    rows = torch.randn(num_rows, 8, generator=generator).bfloat16()
    output = onednn_chunked(rows, weight, sizes)
    assert made == calls
    assert torch.equal(output, _exact(rows, weight))
