"""The transfer benchmark's own pieces move the right bytes (the numbers it prints rest on them).

A small holder process (32 MiB pool), 2 MiB pages, destination pages reversed as in the benchmark.
The holder is killed by pid at the end, whatever happens.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from transfer import MemoryRegion, UcxTransferAgent

pytestmark = pytest.mark.timeout(120)

POOL_BYTES = 32 << 20


def load_bench() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "transfer.py"
    spec = importlib.util.spec_from_file_location("bench_transfer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_pieces_move_the_holders_pages() -> None:
    bench = load_bench()
    page_bytes = 16 * bench.TOKEN_BYTES  # 2 MiB: a 16-token block
    expected = np.random.default_rng(0).integers(0, 256, POOL_BYTES, dtype=np.uint8).reshape(-1, page_bytes)
    src = list(range(8))
    dst = src[::-1]
    holder = bench.Holder(POOL_BYTES)
    agent = UcxTransferAgent()
    try:
        pool = np.zeros(POOL_BYTES, dtype=np.uint8)
        pages = pool.reshape(-1, page_bytes)
        assert bench.cma_read_seconds(holder, pool, page_bytes, src, dst, 2) > 0
        assert np.array_equal(pages[dst], expected[src])

        pool.fill(0)
        agent.register("kv16", MemoryRegion(pool.ctypes.data, page_bytes, POOL_BYTES // page_bytes))
        assert bench.pull_seconds(agent, holder, 16, src, dst) > 0
        assert np.array_equal(pages[dst], expected[src])
        assert agent.lane_bytes() == [4 * page_bytes, 4 * page_bytes]  # 16 MiB: both lanes

        assert bench.perftest_gbps(page_bytes, 8) > 0
    finally:
        agent.close()
        holder.stop()
        holder.process.wait(timeout=10)
