"""UcxTransferAgent on device memory: pools in CUDA memory, passed to UCX as CUDA buffers.

Marked `gpu`: deselected by default and skipped without a CUDA device. Not yet run (no GPU has
been lent to this project's sessions so far). Run on a GPU host with:

    .venv/bin/python -m pytest -m gpu tests/gpu/test_transfer_device.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.transfer_helpers import PeerProcess, seeded_pool
from transfer import MemoryRegion, TransferStatus, UcxTransferAgent

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.timeout(120),
]

SEED = 11
NUM_PAGES = 64
PAGE_BYTES = 1 << 20


@pytest.mark.parametrize("holder_device", ["cuda:0", "cpu"])
def test_pages_land_in_device_memory_exactly(holder_device: str) -> None:
    torch.zeros(1, device="cuda:0")  # a CUDA context exists before UCX's
    pool = torch.zeros((NUM_PAGES, PAGE_BYTES), dtype=torch.uint8, device="cuda:0")
    agent = UcxTransferAgent()
    peer = PeerProcess(NUM_PAGES, PAGE_BYTES, SEED, device=holder_device)
    try:
        agent.register("kv", MemoryRegion(pool.data_ptr(), PAGE_BYTES, NUM_PAGES, device="cuda:0"))
        src = list(range(0, NUM_PAGES, 2))
        dst = list(range(NUM_PAGES - 1, 0, -2))
        offer = peer.call("offer", page_ids=src)
        handle = agent.pull(
            offer["address"], offer["transfer_id"], offer["secret"], "kv", src, "kv", dst, 30.0
        )
        assert handle.wait(30.0) is TransferStatus.DONE, handle.error
        torch.cuda.synchronize()
        expected = seeded_pool(SEED, NUM_PAGES, PAGE_BYTES)
        landed = pool.cpu().numpy()
        assert np.array_equal(landed[dst], expected[src])
        untouched = sorted(set(range(NUM_PAGES)) - set(dst))
        assert not landed[untouched].any()

        # A checksum is host-only: asked for on device memory, the pull is refused at once.
        offer = peer.call("offer", page_ids=[0])
        refused = agent.pull(
            offer["address"], offer["transfer_id"], offer["secret"], "kv", [0], "kv", [0], 5.0, checksum=True
        )
        assert refused.status is TransferStatus.FAILED
        assert "checksum is only supported for host memory" in (refused.error or "")
        peer.call("revoke", transfer_id=offer["transfer_id"])

        stats = agent.stats()
        assert (stats.num_in_flight, stats.num_offers, stats.reserved_bytes) == (0, 0, 0)
        peer_stats = peer.call("stats")
        assert (peer_stats["num_in_flight"], peer_stats["num_offers"], peer_stats["reserved_bytes"]) == (
            0,
            0,
            0,
        )
    finally:
        agent.close()
        peer.kill()
