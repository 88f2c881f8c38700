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


def test_benchmark_pieces_move_the_holders_pages(tmp_path: Path) -> None:
    bench = load_bench()
    page_bytes = 16 * bench.TOKEN_BYTES  # 2 MiB: a 16-token block
    expected = np.random.default_rng(0).integers(0, 256, POOL_BYTES, dtype=np.uint8).reshape(-1, page_bytes)
    src = list(range(8))
    dst = src[::-1]
    holder = bench.Holder(POOL_BYTES, tmp_path / "holder.log")
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

        gbps, reference_protocol = bench.perftest_run(page_bytes, 8, proto_info=True)
        assert gbps > 0
        # Our sends and ucx_perftest's take the same protocol and transport (cma here, whatever
        # this host offers elsewhere), as read from UCX_PROTO_INFO's tables.
        assert reference_protocol is not None
        assert holder.send_protocol(page_bytes) == reference_protocol
    finally:
        agent.close()
        holder.stop()
        holder.process.wait(timeout=10)


PROTO_INFO = """
[1796226430.637366] [vm:9611 :0]   | ucp_context_1 self cfg#0 | tagged message by ucp_tag_send* from host memory            |
[1796226430.637369] [vm:9611 :0]   |                  8K..inf | (?) rendezvous copy from mapped remote memory | self/memory |
[1796226455.195039] [vm:9683 :0]   | perftest intra-node cfg#0 | tagged message by ucp_tag_send* from host memory        |
[1796226455.195039] [vm:9683 :0]   +---------------------------+-------------------------------------------+-------------+
[1796226455.195040] [vm:9683 :0]   |                     0..92 | eager short                               | sysv/memory |
[1796226455.195040] [vm:9683 :0]   |                  93..5028 | eager copy-in copy-out                    | sysv/memory |
[1796226455.195041] [vm:9683 :0]   |                 5029..inf | (?) rendezvous zero-copy read from remote | cma/memory  |
[1796226455.195126] [vm:9683 :0]   | perftest intra-node cfg#0 | tagged message by ucp_tag_send*(multi) from host memory |
[1796226455.195128] [vm:9683 :0]   |                 256K..inf | multi-frag eager copy-in copy-out         | tcp/lo      |
"""


@pytest.mark.parametrize(
    ("message_bytes", "protocol"),
    [
        (64, "eager short over sysv/memory"),
        (5028, "eager copy-in copy-out over sysv/memory"),
        (2 << 20, "rendezvous zero-copy read from remote over cma/memory"),
    ],
)
def test_protocol_is_read_from_the_first_tag_send_table(message_bytes: int, protocol: str) -> None:
    assert load_bench().tag_send_protocol(PROTO_INFO, message_bytes) == protocol


def test_no_table_no_protocol() -> None:
    assert load_bench().tag_send_protocol("Final: 32 0.050 165.969", 1 << 20) is None
