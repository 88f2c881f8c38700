"""Page lists: validation against a region and grouping into runs that travel as one message.

A run is a stretch of pages adjacent on both sides, so it is one contiguous buffer at each end:

    src pages  4 5 6 9      dst pages  0 1 2 3   ->  runs (src 4, dst 0, 3 pages), (src 9, dst 3, 1 page)
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass

from transfer.agent import MemoryRegion, TransferError


@dataclass(frozen=True)
class PageRun:
    src_first: int
    dst_first: int
    num_pages: int


def check_page_ids(page_ids: list[int], region: MemoryRegion, region_name: str) -> None:
    """Raises TransferError unless page_ids are distinct integers inside the region."""
    if not page_ids:
        raise TransferError(f"empty page list for region {region_name!r}")
    for page_id in page_ids:
        if not isinstance(page_id, int) or isinstance(page_id, bool):
            raise TransferError(f"page id {page_id!r} of region {region_name!r} is not an integer")
        if not 0 <= page_id < region.num_pages:
            raise TransferError(
                f"page {page_id} is outside region {region_name!r} (pages 0..{region.num_pages - 1})"
            )
    if len(set(page_ids)) != len(page_ids):
        raise TransferError(f"duplicate page ids for region {region_name!r}")


def plan_runs(src_page_ids: list[int], dst_page_ids: list[int]) -> list[PageRun]:
    if len(src_page_ids) != len(dst_page_ids):
        raise TransferError(f"{len(src_page_ids)} source pages but {len(dst_page_ids)} destination pages")
    runs: list[PageRun] = []
    for src, dst in zip(src_page_ids, dst_page_ids, strict=True):
        if (
            runs
            and src == runs[-1].src_first + runs[-1].num_pages
            and dst == runs[-1].dst_first + runs[-1].num_pages
        ):
            last = runs[-1]
            runs[-1] = PageRun(last.src_first, last.dst_first, last.num_pages + 1)
        else:
            runs.append(PageRun(src, dst, 1))
    return runs


def host_view(region: MemoryRegion, first_page: int, num_pages: int) -> memoryview:
    """A writable view of host pages, aliasing the region (no copy)."""
    import ctypes

    if region.device != "cpu":
        raise TransferError(f"host view asked of a {region.device} region")
    address = region.address + first_page * region.page_bytes
    return memoryview((ctypes.c_ubyte * (num_pages * region.page_bytes)).from_address(address)).cast("B")


def checksum_runs(region: MemoryRegion, runs: list[PageRun], use_src: bool) -> int:
    """CRC-32 over the pages in run order: cheap enough for debugging runs, catches torn pages."""
    value = 0
    for run in runs:
        first = run.src_first if use_src else run.dst_first
        value = zlib.crc32(host_view(region, first, run.num_pages), value)
    return value


class RegionTable:
    """Named regions of one agent; registration is final (a name cannot be rebound)."""

    def __init__(self) -> None:
        self._regions: dict[str, MemoryRegion] = {}
        self._lock = threading.Lock()

    def register(self, name: str, region: MemoryRegion) -> None:
        with self._lock:
            if name in self._regions and self._regions[name] != region:
                raise TransferError(f"region {name!r} is already registered with another layout")
            self._regions[name] = region

    def get(self, name: str) -> MemoryRegion:
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise TransferError(f"unknown region {name!r}")
        return region


def plan_pull(
    regions: RegionTable, dst_region: str, src_page_ids: list[int], dst_page_ids: list[int], checksum: bool
) -> tuple[MemoryRegion, list[PageRun]]:
    """The puller's checks before anything is sent (both agents): the destination region and its
    pages exist, the page lists pair up, a checksum is only asked of host memory. Raises
    TransferError naming what is wrong; returns the destination region and the runs to move."""
    destination = regions.get(dst_region)
    check_page_ids(dst_page_ids, destination, dst_region)
    runs = plan_runs(src_page_ids, dst_page_ids)
    if checksum and destination.device != "cpu":
        raise TransferError("checksum is only supported for host memory")
    return destination, runs
