"""LoopbackTransferAgent: the transfer rules, in one process (the UCX agent is held to the same)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from transfer import (
    LoopbackHub,
    LoopbackTransferAgent,
    MemoryRegion,
    TransferAgent,
    TransferStatus,
    UcxTransferAgent,
)

PAGE_BYTES = 4096
NUM_PAGES = 64


class Side:
    def __init__(self, hub: LoopbackHub, seed: int) -> None:
        self.agent: TransferAgent = LoopbackTransferAgent(hub)
        self.pool = np.random.default_rng(seed).integers(0, 256, (NUM_PAGES, PAGE_BYTES), dtype=np.uint8)
        self.agent.register("kv", MemoryRegion(self.pool.ctypes.data, PAGE_BYTES, NUM_PAGES))


@pytest.fixture
def sides() -> Iterator[tuple[Side, Side, LoopbackHub]]:
    hub = LoopbackHub()
    holder, puller = Side(hub, 1), Side(hub, 2)
    try:
        yield holder, puller, hub
        for side in (holder, puller):
            stats = side.agent.stats()
            assert (stats.num_in_flight, stats.num_offers, stats.reserved_bytes) == (0, 0, 0), stats
    finally:
        holder.agent.close()
        puller.agent.close()


def test_pull_moves_exact_bytes_and_fires_done_once(sides: tuple[Side, Side, LoopbackHub]) -> None:
    holder, puller, _ = sides
    ended: list[tuple[str, TransferStatus]] = []
    offer = holder.agent.offer(
        "kv", [3, 4, 5, 9], ttl_s=5.0, on_done=lambda tid, status: ended.append((tid, status))
    )
    before = puller.pool.copy()
    handle = puller.agent.pull(
        offer.address,
        offer.transfer_id,
        offer.secret,
        "kv",
        [3, 4, 5, 9],
        "kv",
        [0, 1, 2, 7],
        5.0,
        checksum=True,
    )
    assert handle.wait(5.0) is TransferStatus.DONE, handle.error
    assert np.array_equal(puller.pool[[0, 1, 2, 7]], holder.pool[[3, 4, 5, 9]])
    untouched = [page for page in range(NUM_PAGES) if page not in (0, 1, 2, 7)]
    assert np.array_equal(puller.pool[untouched], before[untouched])
    assert handle.num_messages == 2 and handle.bytes_moved == 4 * PAGE_BYTES
    assert ended == [(offer.transfer_id, TransferStatus.DONE)]


@pytest.mark.parametrize(
    "secret_kind, src_pages, expected_text",
    [
        ("wrong", [0], "wrong secret"),
        ("right", [NUM_PAGES], "outside region"),
        ("right", [1], "not part of transfer"),
    ],
)
def test_refused_pulls_write_nothing(
    sides: tuple[Side, Side, LoopbackHub], secret_kind: str, src_pages: list[int], expected_text: str
) -> None:
    holder, puller, _ = sides
    offer = holder.agent.offer("kv", [0], ttl_s=5.0)
    before = puller.pool.copy()
    secret = offer.secret if secret_kind == "right" else "0" * len(offer.secret)
    handle = puller.agent.pull(offer.address, offer.transfer_id, secret, "kv", src_pages, "kv", [0], 5.0)
    assert handle.wait(5.0) is TransferStatus.FAILED and expected_text in (handle.error or "")
    assert np.array_equal(puller.pool, before)
    holder.agent.revoke(offer.transfer_id)


def test_reused_secret_refused(sides: tuple[Side, Side, LoopbackHub]) -> None:
    holder, puller, _ = sides
    offer = holder.agent.offer("kv", [0], ttl_s=5.0)
    args = (offer.address, offer.transfer_id, offer.secret, "kv", [0], "kv", [0], 5.0)
    assert puller.agent.pull(*args).wait(5.0) is TransferStatus.DONE
    again = puller.agent.pull(*args)
    assert again.wait(5.0) is TransferStatus.FAILED and "already used" in (again.error or "")


def test_stalled_holder_times_out_within_bound(sides: tuple[Side, Side, LoopbackHub]) -> None:
    holder, puller, hub = sides
    ended: list[TransferStatus] = []
    offer = holder.agent.offer("kv", [0, 1], ttl_s=0.05, on_done=lambda tid, status: ended.append(status))
    hub.stall(offer.address)
    start = time.monotonic()
    handle = puller.agent.pull(
        offer.address, offer.transfer_id, offer.secret, "kv", [0, 1], "kv", [0, 1], 0.2
    )
    assert handle.wait(2.0) is TransferStatus.TIMED_OUT
    assert time.monotonic() - start < 1.0
    assert ended == [TransferStatus.TIMED_OUT]


def test_lease_lapses_and_extend_keeps_it(sides: tuple[Side, Side, LoopbackHub]) -> None:
    holder, _, _ = sides
    ended: list[TransferStatus] = []
    kept = holder.agent.offer("kv", [0], ttl_s=0.05, on_done=lambda tid, status: ended.append(status))
    lapsed = holder.agent.offer("kv", [1], ttl_s=0.05, on_done=lambda tid, status: ended.append(status))
    assert holder.agent.extend(kept.transfer_id, 5.0)
    time.sleep(0.2)
    assert ended == [TransferStatus.TIMED_OUT] and not holder.agent.extend(lapsed.transfer_id, 1.0)
    holder.agent.revoke(kept.transfer_id)
    assert ended == [TransferStatus.TIMED_OUT, TransferStatus.CANCELLED]


@pytest.mark.parametrize("cancelling_side", ["holder", "puller"])
def test_cancel_from_either_side_frees_both(
    sides: tuple[Side, Side, LoopbackHub], cancelling_side: str
) -> None:
    holder, puller, hub = sides
    ended: list[TransferStatus] = []
    offer = holder.agent.offer("kv", [0], ttl_s=5.0, on_done=lambda tid, status: ended.append(status))
    hub.stall(offer.address)
    handle = puller.agent.pull(offer.address, offer.transfer_id, offer.secret, "kv", [0], "kv", [0], 5.0)
    assert handle.status is TransferStatus.TRANSFERRING and puller.agent.stats().reserved_bytes == PAGE_BYTES
    if cancelling_side == "holder":
        holder.agent.revoke(offer.transfer_id)
    else:
        handle.cancel()
    assert handle.wait(1.0) is TransferStatus.CANCELLED and ended == [TransferStatus.CANCELLED]


def test_many_concurrent_pulls(sides: tuple[Side, Side, LoopbackHub]) -> None:
    holder, puller, _ = sides
    offers = [holder.agent.offer("kv", [page], ttl_s=5.0) for page in range(NUM_PAGES)]
    handles = [
        puller.agent.pull(o.address, o.transfer_id, o.secret, "kv", [page], "kv", [NUM_PAGES - 1 - page], 5.0)
        for page, o in enumerate(offers)
    ]
    assert all(handle.wait(5.0) is TransferStatus.DONE for handle in handles)
    assert np.array_equal(puller.pool[::-1], holder.pool)


@pytest.mark.parametrize("kind", ["loopback", "ucx"])
@pytest.mark.parametrize(
    "dst_region, src_pages, dst_pages, checksum, expected_text",
    [
        ("nope", [0], [0], False, "nope"),
        ("kv", [0, 1], [0], False, "2 source pages but 1 destination pages"),
        ("kv", [0], [NUM_PAGES], False, "outside region"),
        ("gpu", [0], [0], True, "checksum is only supported for host memory"),
    ],
)
def test_puller_refuses_a_bad_pull_before_anything_is_sent(
    kind: str, dst_region: str, src_pages: list[int], dst_pages: list[int], checksum: bool, expected_text: str
) -> None:
    """Both agents run the same checks on the puller's side: the handle comes back FAILED at once,
    naming the problem, and nothing is reserved."""
    agent: TransferAgent = LoopbackTransferAgent(LoopbackHub()) if kind == "loopback" else UcxTransferAgent()
    try:
        pool = np.zeros((NUM_PAGES, PAGE_BYTES), dtype=np.uint8)
        agent.register("kv", MemoryRegion(pool.ctypes.data, PAGE_BYTES, NUM_PAGES))
        agent.register("gpu", MemoryRegion(1 << 40, PAGE_BYTES, NUM_PAGES, device="cuda:0"))
        handle = agent.pull("127.0.0.1:9", "t", "s", "kv", src_pages, dst_region, dst_pages, 5.0, checksum)
        assert handle.status is TransferStatus.FAILED
        assert expected_text in (handle.error or ""), handle.error
        stats = agent.stats()
        assert (stats.num_in_flight, stats.reserved_bytes) == (0, 0)
    finally:
        agent.close()


def test_holder_learns_how_many_pages_were_pulled(sides: tuple[Side, Side, LoopbackHub]) -> None:
    holder, puller, _ = sides
    seen_in_callback: list[int] = []
    offer = holder.agent.offer(
        "kv",
        [3, 4, 5],
        ttl_s=5.0,
        on_done=lambda tid, status: seen_in_callback.append(holder.agent.num_pages_pulled(tid)),
    )
    assert holder.agent.num_pages_pulled(offer.transfer_id) == 0
    handle = puller.agent.pull(offer.address, offer.transfer_id, offer.secret, "kv", [5], "kv", [0], 5.0)
    assert handle.wait(5.0) is TransferStatus.DONE, handle.error
    deadline = time.monotonic() + 5.0
    while not seen_in_callback and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen_in_callback == [1]  # one page of the three offered
    assert holder.agent.num_pages_pulled(offer.transfer_id) == 1
    assert holder.agent.num_pages_pulled("unknown") == 0
