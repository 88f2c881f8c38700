"""UcxTransferAgent between two real processes over loopback: this test process pulls from a helper.

Every test ends by checking that both sides hold nothing: no transfer in flight, no offer, no bytes
reserved. Helpers bind port 0 (the kernel picks a free port) and are killed by pid in `finally`.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.transfer_helpers import PeerProcess, seeded_pool
from transfer import MemoryRegion, PullHandle, TransferStatus, UcxTransferAgent
from transfer.control import ControlMessage, MessageKind
from transfer.ucx_binding import BINDING_ENV, installed_bindings

pytestmark = pytest.mark.timeout(30)

SEED = 7


@pytest.fixture(autouse=True, params=installed_bindings())
def binding(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs once per installed UCX binding (ucxx here; ucp too where ucx-py is
    installed), on both sides: the helper process inherits the environment."""
    monkeypatch.setenv(BINDING_ENV, request.param)
    return str(request.param)


class LocalSide:
    def __init__(self, num_pages: int, page_bytes: int, **agent_arguments: Any) -> None:
        self.agent = UcxTransferAgent(**agent_arguments)
        assert self.agent.binding_name == os.environ[BINDING_ENV]
        self.pool = np.zeros((num_pages, page_bytes), dtype=np.uint8)
        self.agent.register("kv", MemoryRegion(self.pool.ctypes.data, page_bytes, num_pages))

    def pull(
        self,
        peer: PeerProcess,
        src_page_ids: list[int],
        dst_page_ids: list[int],
        timeout_s: float = 10.0,
        **offer_arguments: object,
    ) -> tuple[dict, PullHandle]:
        offer = peer.call("offer", page_ids=src_page_ids, **offer_arguments)
        handle = self.agent.pull(
            offer["address"],
            offer["transfer_id"],
            offer["secret"],
            "kv",
            src_page_ids,
            "kv",
            dst_page_ids,
            timeout_s,
            checksum=True,
        )
        return offer, handle


def assert_idle(local: LocalSide, peer: PeerProcess | None) -> None:
    deadline = time.monotonic() + 5.0
    while True:
        local_stats = local.agent.stats()
        peer_stats = (
            peer.call("stats")
            if peer is not None
            else {"num_in_flight": 0, "num_offers": 0, "reserved_bytes": 0}
        )
        local_tuple = (local_stats.num_in_flight, local_stats.num_offers, local_stats.reserved_bytes)
        peer_tuple = (peer_stats["num_in_flight"], peer_stats["num_offers"], peer_stats["reserved_bytes"])
        if local_tuple == peer_tuple == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert local_tuple == (0, 0, 0) and peer_tuple == (0, 0, 0), (local_tuple, peer_tuple)


def holder_events(peer: PeerProcess, count: int, timeout_s: float = 5.0) -> list[str]:
    """The holder's on_done statuses once there are at least `count` (or whatever came by the timeout).

    The puller can see DONE, and both sides' stats can read idle, before the holder's on_done has
    run: it fires on the holder's loop thread after the DONE message arrives and after the offer has
    left the book. So tests poll for it instead of asserting at once.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = [status for _, status in peer.call("events")["events"]]
        if len(statuses) >= count or time.monotonic() > deadline:
            return statuses
        time.sleep(0.01)


def two_sides(
    num_pages: int, page_bytes: int, **agent_arguments: Any
) -> Iterator[tuple[LocalSide, PeerProcess]]:
    peer = None
    local = None
    try:
        peer = PeerProcess(num_pages, page_bytes, SEED)
        local = LocalSide(num_pages, page_bytes, **agent_arguments)
        assert peer.binding == os.environ[BINDING_ENV]
        yield local, peer
    finally:
        if local is not None:
            local.agent.close()
        if peer is not None:
            peer.kill()


@pytest.fixture
def small() -> Iterator[tuple[LocalSide, PeerProcess]]:
    yield from two_sides(num_pages=128, page_bytes=16 << 10)


@pytest.fixture(params=["lane 0 only", "every pull on both lanes"])
def small_any_lanes(request: pytest.FixtureRequest) -> Iterator[tuple[LocalSide, PeerProcess, int]]:
    """Small pages, with pulls on lane 0 alone (the default split) or on both lanes; also yields
    the number of pages each pull of two runs puts on lane 1."""
    split, on_lane_1 = {"lane 0 only": (4 << 20, 0), "every pull on both lanes": (0, 1)}[request.param]
    for local, peer in two_sides(num_pages=128, page_bytes=16 << 10, lane_split_bytes=split):
        yield local, peer, on_lane_1


@pytest.fixture
def large() -> Iterator[tuple[LocalSide, PeerProcess]]:
    yield from two_sides(num_pages=128, page_bytes=1 << 20)


def test_bytes_arrive_exactly(small: tuple[LocalSide, PeerProcess]) -> None:
    local, peer = small
    expected = seeded_pool(SEED, 128, 16 << 10)
    src, dst = [5, 6, 7, 40, 41, 90], [0, 1, 2, 3, 4, 100]  # runs: 5-7 to 0-2, 40-41 to 3-4, 90 to 100
    _, handle = local.pull(peer, src, dst)
    assert handle.wait(10.0) is TransferStatus.DONE, handle.error
    assert np.array_equal(local.pool[dst], expected[src])
    assert not local.pool[[page for page in range(128) if page not in dst]].any()
    assert handle.num_messages == 3 and handle.bytes_moved == 6 * (16 << 10)
    # 96 KiB is less than one lane's worth (lane_split_bytes, 4 MiB): lane 0 alone, no hand-off.
    assert local.agent.lane_bytes() == [6 * (16 << 10), 0]
    assert holder_events(peer, 1) == ["DONE"]
    assert_idle(local, peer)


def test_a_pull_is_spread_over_the_lanes() -> None:
    peer = PeerProcess(128, 16 << 10, SEED)
    local = LocalSide(128, 16 << 10, lane_split_bytes=32 << 10)  # a lane per 2 pages
    try:
        expected = seeded_pool(SEED, 128, 16 << 10)
        src, dst = [5, 6, 7, 40, 41, 90], [0, 1, 2, 3, 4, 100]
        _, handle = local.pull(peer, src, dst)
        assert handle.wait(10.0) is TransferStatus.DONE, handle.error
        assert np.array_equal(local.pool[dst], expected[src])
        # Runs of 3, 2 and 1 pages go to lanes 0, 1, 1 (each to the one with the fewest bytes).
        assert local.agent.lane_bytes() == [3 * (16 << 10), 3 * (16 << 10)]
        assert_idle(local, peer)
    finally:
        local.agent.close()
        peer.kill()


@pytest.mark.parametrize("lanes", [1, 3])
def test_any_number_of_lanes_moves_the_same_bytes(lanes: int) -> None:
    peer = PeerProcess(64, 16 << 10, SEED)
    local = LocalSide(64, 16 << 10, lanes=lanes, lane_split_bytes=0)
    try:
        expected = seeded_pool(SEED, 64, 16 << 10)
        src, dst = list(range(0, 20, 2)), list(range(63, 53, -1))  # 10 single-page runs
        _, handle = local.pull(peer, src, dst)
        assert handle.wait(10.0) is TransferStatus.DONE, handle.error
        assert np.array_equal(local.pool[dst], expected[src])
        assert sum(local.agent.lane_bytes()) == 10 * (16 << 10)
        assert min(local.agent.lane_bytes()) >= 3 * (16 << 10)  # spread over every lane
        assert_idle(local, peer)
    finally:
        local.agent.close()
        peer.kill()


@pytest.mark.parametrize(
    ("run_lanes", "num_addresses", "error"),
    [
        ([1], 1, "names a lane that does not exist"),
        ([0, 0], 1, "malformed lanes"),
        ([0], 0, "malformed lanes"),
    ],
)
def test_pull_naming_bad_lanes_is_refused_and_the_offer_survives(
    small: tuple[LocalSide, PeerProcess], run_lanes: list[int], num_addresses: int, error: str
) -> None:
    local, peer = small
    offer = peer.call("offer", page_ids=[3])
    host, _, port = peer.address.rpartition(":")
    pull = ControlMessage(
        MessageKind.PULL,
        offer["transfer_id"],
        secret=offer["secret"],
        region="kv",
        runs=[(3, 1)],
        tag_base=1 << 40,
        lane_addresses=["00" * 8] * num_addresses,
        run_lanes=run_lanes,
        timeout_s=5.0,
    )
    with socket.create_connection((host, int(port)), timeout=5.0) as probe:
        probe.sendall(pull.encode())
        reply = _read_frame(probe)
    assert reply.kind is MessageKind.ERROR and error in reply.error, reply
    handle = local.agent.pull(
        offer["address"], offer["transfer_id"], offer["secret"], "kv", [3], "kv", [9], 10.0
    )
    assert handle.wait(10.0) is TransferStatus.DONE, handle.error  # the refused request claimed nothing
    assert np.array_equal(local.pool[9], seeded_pool(SEED, 128, 16 << 10)[3])
    assert_idle(local, peer)


def _read_frame(sock: socket.socket) -> ControlMessage:
    def read_exactly(count: int) -> bytes:
        data = b""
        while len(data) < count:
            chunk = sock.recv(count - len(data))
            assert chunk, "the holder closed the connection without answering"
            data += chunk
        return data

    (length,) = struct.unpack("!I", read_exactly(4))
    return ControlMessage.decode(read_exactly(length))


def test_64_concurrent_pulls_all_correct(small_any_lanes: tuple[LocalSide, PeerProcess, int]) -> None:
    local, peer, on_lane_1 = small_any_lanes
    expected = seeded_pool(SEED, 128, 16 << 10)
    pulls = [local.pull(peer, [2 * index, 2 * index + 1], [127 - index, 63 - index]) for index in range(64)]
    for _, handle in pulls:
        assert handle.wait(20.0) is TransferStatus.DONE, handle.error
    for index in range(64):
        assert np.array_equal(local.pool[[127 - index, 63 - index]], expected[[2 * index, 2 * index + 1]])
    assert local.agent.lane_bytes() == [(128 - 64 * on_lane_1) * (16 << 10), 64 * on_lane_1 * (16 << 10)]
    assert_idle(local, peer)


@pytest.mark.parametrize("fault", ["out_of_range", "not_offered", "wrong_secret", "reused_secret"])
def test_refused_pulls_write_nothing(small: tuple[LocalSide, PeerProcess], fault: str) -> None:
    local, peer = small
    offer = peer.call("offer", page_ids=[1, 2])
    secret, src = offer["secret"], [1, 2]
    if fault == "out_of_range":
        src = [1, 128]
    elif fault == "not_offered":
        src = [1, 3]
    elif fault == "wrong_secret":
        secret = "f" * len(secret)
    elif fault == "reused_secret":
        first = local.agent.pull(
            offer["address"], offer["transfer_id"], secret, "kv", src, "kv", [10, 11], 10.0
        )
        assert first.wait(10.0) is TransferStatus.DONE
        local.pool[:] = 0
    handle = local.agent.pull(offer["address"], offer["transfer_id"], secret, "kv", src, "kv", [0, 1], 10.0)
    assert handle.wait(10.0) is TransferStatus.FAILED
    reason = {
        "out_of_range": "outside region",
        "not_offered": "not part of",
        "wrong_secret": "wrong secret",
        "reused_secret": "already used",
    }[fault]
    assert reason in (handle.error or ""), handle.error
    assert not local.pool.any()
    if fault != "reused_secret":
        peer.call("revoke", transfer_id=offer["transfer_id"])  # the offer survived the refusal
    assert_idle(local, peer)


def test_sender_that_never_sends_times_out_within_bound(small: tuple[LocalSide, PeerProcess]) -> None:
    local, peer = small
    offer = peer.call("offer", page_ids=[0, 1])
    peer.signal(signal.SIGSTOP)
    start = time.monotonic()
    handle = local.agent.pull(
        offer["address"], offer["transfer_id"], offer["secret"], "kv", [0, 1], "kv", [0, 1], 1.0
    )
    assert handle.wait(5.0) is TransferStatus.TIMED_OUT
    assert time.monotonic() - start < 2.0
    assert not local.pool.any()
    peer.signal(signal.SIGCONT)
    assert_idle(local, peer)
    assert holder_events(peer, 1) == ["TIMED_OUT"]


def test_sender_killed_mid_transfer_fails_within_bound(large: tuple[LocalSide, PeerProcess]) -> None:
    local, peer = large
    offer = peer.call("offer", page_ids=list(range(128)))
    peer.call("die_when_serving")
    start = time.monotonic()
    handle = local.agent.pull(
        offer["address"],
        offer["transfer_id"],
        offer["secret"],
        "kv",
        list(range(128)),
        "kv",
        list(range(127, -1, -1)),
        10.0,
    )
    assert handle.wait(5.0) is TransferStatus.FAILED, handle
    assert time.monotonic() - start < 5.0 and "holder closed" in (handle.error or "")
    assert_idle(local, None)


@pytest.mark.parametrize("cancelling_side", ["puller", "holder"])
def test_cancel_from_either_side_frees_both(
    large: tuple[LocalSide, PeerProcess], cancelling_side: str
) -> None:
    local, peer = large
    pages = list(range(128))
    num_offers = 1
    if cancelling_side == "puller":
        offer = peer.call("offer", page_ids=pages)
        peer.signal(signal.SIGSTOP)  # the holder cannot finish before the cancel
        handle = local.agent.pull(
            offer["address"], offer["transfer_id"], offer["secret"], "kv", pages, "kv", pages, 10.0
        )
        handle.cancel()
        peer.signal(signal.SIGCONT)
    else:
        # The holder revokes a few milliseconds after it starts serving; a 128 MiB pull takes longer,
        # but a loaded host can delay the revoking thread, so a pull that wins the race is retried.
        for attempt in range(3):
            num_offers = attempt + 1
            offer = peer.call("offer", page_ids=pages)
            peer.call("revoke_when_serving")
            handle = local.agent.pull(
                offer["address"], offer["transfer_id"], offer["secret"], "kv", pages, "kv", pages[::-1], 10.0
            )
            if handle.wait(5.0) is not TransferStatus.DONE:
                break
            assert_idle(local, peer)
    assert handle.wait(5.0) is TransferStatus.CANCELLED, handle
    assert_idle(local, peer)
    assert holder_events(peer, num_offers)[-1:] == ["CANCELLED"]


def test_cancelled_pull_on_both_lanes_writes_nothing_afterwards(large: tuple[LocalSide, PeerProcess]) -> None:
    """Cancel while the holder is stopped, then let it run: it reads the PULL before the CANCEL and
    sends, but both lanes closed their receives before cancel() returned, so no byte may land."""
    local, peer = large
    pages = list(range(128))
    offer = peer.call("offer", page_ids=pages)
    peer.signal(signal.SIGSTOP)
    handle = local.agent.pull(
        offer["address"], offer["transfer_id"], offer["secret"], "kv", pages, "kv", pages[::-1], 10.0
    )
    time.sleep(0.2)  # the PULL is in the holder's socket buffer, the receives are posted
    handle.cancel()
    assert handle.status is TransferStatus.CANCELLED
    peer.signal(signal.SIGCONT)
    assert holder_events(peer, 1) == ["CANCELLED"]
    time.sleep(0.3)
    assert not local.pool.any()
    assert local.agent.lane_bytes() == [0, 0]
    assert_idle(local, peer)
    # The lanes go on serving: the next pull over both of them lands whole.
    offer = peer.call("offer", page_ids=pages)
    handle = local.agent.pull(
        offer["address"], offer["transfer_id"], offer["secret"], "kv", pages, "kv", pages[::-1], 10.0
    )
    assert handle.wait(10.0) is TransferStatus.DONE, handle.error
    assert np.array_equal(local.pool[pages[::-1]], seeded_pool(SEED, 128, 1 << 20)[pages])
    assert local.agent.lane_bytes() == [64 << 20, 64 << 20]
    assert_idle(local, peer)


def test_garbage_on_the_control_port_harms_nothing(small: tuple[LocalSide, PeerProcess]) -> None:
    local, peer = small
    host, _, port = peer.address.rpartition(":")
    for payload in (b"\x00\x00\x00\x05hello", b"\xff\xff\xff\xff", b'\x00\x00\x00\x10{"kind": "pull"}'):
        with socket.create_connection((host, int(port)), timeout=2.0) as probe:
            probe.sendall(payload)
    expected = seeded_pool(SEED, 128, 16 << 10)
    _, handle = local.pull(peer, [3], [4])
    assert handle.wait(10.0) is TransferStatus.DONE, handle.error
    assert np.array_equal(local.pool[4], expected[3])
    assert_idle(local, peer)


def test_binding_is_chosen_by_name_and_a_bad_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BINDING_ENV, "ucx-py")
    with pytest.raises(ValueError, match="BEAMSPLIT_UCX_BINDING"):
        UcxTransferAgent()
    missing = next((name for name in ("ucxx", "ucp") if name not in installed_bindings()), None)
    if missing is not None:
        monkeypatch.setenv(BINDING_ENV, missing)
        with pytest.raises(RuntimeError, match=f"tried {missing}"):
            UcxTransferAgent()
