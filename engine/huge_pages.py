"""Puts the packed linear weights on 2 MiB pages once they are written (Linux's MADV_COLLAPSE).

Why: a decode step streams every weight from memory once (537 MiB in float32 for SmolLM2-135M),
and on 4 KiB pages that is a TLB miss every 4 KiB, a page walk the step waits for. Collapsing the
weights' pages into transparent huge pages after packing made a lone beam-4 request 3.6-7%
faster in float32 and 2.4-3.9% in bfloat16, and 16 beam-4 requests at once 1-4% (float32; the
same process with and without, alternated, docs/benchmarks.md stop 35). It costs about 1 s at
start-up for 300 MiB in float32.

What: each packed weight's whole 2 MiB pages (a buffer's aligned interior: a weight under 2 MiB,
or its ends, stays on small pages) are collapsed in place by `madvise(MADV_COLLAPSE)`, which copies
them into huge pages synchronously and leaves the contents as they were. Best effort: where the
kernel lacks it (before Linux 6.1), transparent huge pages are off (`never`), or no huge page is
free, the call fails and the weights stay where they are; nothing else changes. The KV pool is
left alone: its pages are first touched while serving, and a huge page's fault there (zeroing and
compacting 2 MiB) took 6 ms a page on the benchmark host.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

from engine.heap import c_library

HUGE_PAGE_BYTES = 2 << 20
MADV_COLLAPSE = 25  # linux/mman.h, Linux 6.1+


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    library = c_library()
    if not sys.platform.startswith("linux") or library is None or not hasattr(library, "madvise"):
        return None
    function = library.madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def huge_page_span(address: int, num_bytes: int) -> tuple[int, int]:
    """(start, length) of the whole 2 MiB pages inside [address, address + num_bytes); length 0
    where there is none."""
    start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (address + num_bytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return start, max(0, end - start)


def collapse(address: int, num_bytes: int) -> int:
    """Collapses the whole 2 MiB pages of a written buffer into huge pages; returns the bytes
    collapsed (0 where the system cannot)."""
    madvise = _madvise()
    start, length = huge_page_span(address, num_bytes)
    if madvise is None or length == 0:
        return 0
    return length if madvise(start, length, MADV_COLLAPSE) == 0 else 0
