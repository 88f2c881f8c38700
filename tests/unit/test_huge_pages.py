"""Packed weights on 2 MiB pages (engine/huge_pages.py): only a buffer's whole huge pages are
collapsed, the contents and a layer's outputs stay the same bits, and where the system cannot
collapse nothing fails."""

from __future__ import annotations

import mmap
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from engine import huge_pages
from engine.packed_linear import PackedLinear, collapse_packed_weights
from tests.helpers.onednn_host import NO_BFLOAT16_REASON, onednn_packs

MIB = 1 << 20


def _huge_pages_usable() -> str | None:
    """None where this system can collapse pages (the reason it cannot, otherwise)."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.exists() or "[never]" in setting.read_text():
        return "transparent huge pages are off"
    release = tuple(int(part) for part in re.findall(r"\d+", os.uname().release)[:2])
    if release < (6, 1):
        return f"Linux {os.uname().release} has no MADV_COLLAPSE (6.1 and later)"
    return None


def _huge_bytes_in(address: int, num_bytes: int) -> int:
    """AnonHugePages of the mappings that overlap [address, address + num_bytes), from
    /proc/self/smaps (a heap buffer may span more than one mapping)."""
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            overlaps = low < address + num_bytes and address < high
        elif overlaps and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.parametrize(
    ("address", "num_bytes", "span"),
    [
        (0, 4 * MIB, (0, 4 * MIB)),  # aligned: every page
        (4096, 4 * MIB, (2 * MIB, 2 * MIB)),  # the first and the last partial pages left out
        (2 * MIB - 1, 2 * MIB + 2, (2 * MIB, 2 * MIB)),
        (4096, 2 * MIB, (2 * MIB, 0)),  # no whole huge page inside
        (3 * MIB, MIB, (4 * MIB, 0)),
    ],
)
def test_only_whole_huge_pages_inside_a_buffer_are_taken(
    address: int, num_bytes: int, span: tuple[int, int]
) -> None:
    assert huge_pages.huge_page_span(address, num_bytes) == span


def test_a_collapsed_buffer_keeps_its_bytes_and_sits_on_huge_pages() -> None:
    reason = _huge_pages_usable()
    if reason is not None:
        pytest.skip(reason)
    # A mapping of its own: on the shared heap another test's free or trim may split its huge pages.
    mapping = mmap.mmap(-1, 9 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    buffer.copy_(torch.randint(0, 256, (9 * MIB,), dtype=torch.uint8))
    before = buffer.clone()
    collapsed = huge_pages.collapse(buffer.data_ptr(), buffer.numel())
    start, length = huge_pages.huge_page_span(buffer.data_ptr(), buffer.numel())
    assert collapsed == length >= 6 * MIB
    assert _huge_bytes_in(start, length) >= length
    assert torch.equal(buffer, before)


def test_a_buffer_under_a_huge_page_is_left_alone() -> None:
    small = torch.ones(MIB, dtype=torch.uint8)
    assert huge_pages.collapse(small.data_ptr(), small.numel()) == 0
    assert huge_pages.collapse(small.data_ptr(), 0) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_on_huge_pages_give_the_same_outputs(dtype: torch.dtype) -> None:
    """A layer's outputs before and after its packed weight moves, bit for bit; the bytes packed
    are the weights' own, and where the system can, most of a large weight is collapsed."""
    if not onednn_packs(dtype):
        pytest.skip(NO_BFLOAT16_REASON)
    torch.manual_seed(0)
    linear = nn.Linear(1024, 4096, bias=False).to(dtype)  # 16 or 8 MiB
    model = nn.Sequential(
        PackedLinear.from_linear(linear, shared=False), PackedLinear.from_linear(linear, shared=False)
    )
    rows = torch.randn(5, 1024).to(dtype)
    before = [layer(rows) for layer in model]
    collapsed, packed = collapse_packed_weights(model)
    assert packed == 2 * linear.weight.numel() * linear.weight.element_size()
    for layer, output in zip(model, before, strict=True):
        assert torch.equal(layer(rows), output)
    if _huge_pages_usable() is None:
        assert collapsed >= packed - 2 * 2 * huge_pages.HUGE_PAGE_BYTES  # at most each end's partial page
    else:
        assert collapsed == 0
