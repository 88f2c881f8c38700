"""The per-transfer secret, over real UCX between two processes (a helper holds, this process pulls).

A holder serves an offer's pages only to the one PULL that names its transfer id with its secret,
once: a secret is useless after its transfer ends, however it ended, and control messages that
carry no (or another transfer's) secret cannot end, claim or steal an offer. Every refusal writes
not one byte into the puller's pool. (Wrong secret and a second pull after DONE:
tests/integration/test_transfer_ucx.py, test_refused_pulls_write_nothing.)
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.integration.test_transfer_ucx import (  # noqa: F401  (binding: every installed UCX binding)
    SEED,
    LocalSide,
    PeerProcess,
    _read_frame,
    assert_idle,
    binding,
    holder_events,
    two_sides,
)
from tests.transfer_helpers import seeded_pool
from transfer import TransferStatus
from transfer.control import ControlMessage, MessageKind

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def sides() -> Iterator[tuple[LocalSide, PeerProcess]]:
    yield from two_sides(num_pages=128, page_bytes=16 << 10)


def pull_again(local: LocalSide, offer: dict, dst_pages: list[int]) -> tuple[TransferStatus, str]:
    handle = local.agent.pull(
        offer["address"], offer["transfer_id"], offer["secret"], "kv", [1, 2], "kv", dst_pages, 10.0
    )
    return handle.wait(10.0), handle.error or ""


@pytest.mark.parametrize("ending", ["revoked", "lease_lapsed", "cancelled_by_puller"])
def test_a_secret_is_useless_once_its_transfer_ended(
    sides: tuple[LocalSide, PeerProcess], ending: str
) -> None:
    local, peer = sides
    offer = peer.call("offer", page_ids=[1, 2], ttl_s=0.3 if ending == "lease_lapsed" else 10.0)
    expected_end = {"revoked": "CANCELLED", "lease_lapsed": "TIMED_OUT", "cancelled_by_puller": "CANCELLED"}
    if ending == "revoked":
        peer.call("revoke", transfer_id=offer["transfer_id"])
    elif ending == "cancelled_by_puller":
        peer.signal(signal.SIGSTOP)  # the PULL and the CANCEL wait in the socket; the holder sees both
        handle = local.agent.pull(
            offer["address"], offer["transfer_id"], offer["secret"], "kv", [1, 2], "kv", [5, 6], 10.0
        )
        handle.cancel()
        peer.signal(signal.SIGCONT)
        assert handle.wait(5.0) is TransferStatus.CANCELLED
    assert holder_events(peer, 1) == [expected_end[ending]]  # lapsed: the holder's timer ended it
    local.pool[:] = 0
    status, error = pull_again(local, offer, [10, 11])
    assert status is TransferStatus.FAILED and "already ended" in error and "secret already used" in error, (
        error
    )
    assert not local.pool.any()
    assert_idle(local, peer)
    assert holder_events(peer, 1) == [expected_end[ending]]  # the refused pull ended nothing more


def test_control_messages_without_the_secret_leave_the_offer_alone(
    sides: tuple[LocalSide, PeerProcess],
) -> None:
    local, peer = sides
    offer = peer.call("offer", page_ids=[1, 2])
    other = peer.call("offer", page_ids=[3])
    host, _, port = offer["address"].rpartition(":")

    def pull_message(transfer_id: str, secret: str) -> ControlMessage:
        return ControlMessage(
            MessageKind.PULL,
            transfer_id,
            secret=secret,
            region="kv",
            runs=[(1, 2)] if transfer_id == offer["transfer_id"] else [(3, 1)],
            tag_base=1 << 40,
            lane_addresses=["00" * 8],  # a claim that got past the secret would end the offer FAILED
            run_lanes=[0],
            timeout_s=5.0,
        )

    refused = [
        pull_message(offer["transfer_id"], ""),  # no secret
        pull_message(offer["transfer_id"], other["secret"]),  # another transfer's secret
        pull_message(other["transfer_id"], offer["secret"]),
        pull_message(offer["transfer_id"], offer["secret"].upper()),  # almost right
    ]
    for message in refused:
        with socket.create_connection((host, int(port)), timeout=5.0) as probe:
            probe.sendall(message.encode())
            reply = _read_frame(probe)
        assert reply.kind is MessageKind.ERROR and "wrong secret" in reply.error, reply
    # Messages that only a puller holding the offer may send, from a connection that claimed nothing.
    for kind in (MessageKind.DONE, MessageKind.CANCEL):
        with socket.create_connection((host, int(port)), timeout=5.0) as probe:
            probe.sendall(ControlMessage(kind, offer["transfer_id"], status="DONE").encode())
            probe.settimeout(5.0)
            assert probe.recv(1 << 16) == b""  # the holder hangs up without a word
    time.sleep(0.1)
    assert peer.call("stats")["num_offers"] == 2  # both offers alive, nothing ended
    assert peer.call("events")["events"] == []
    assert not local.pool.any()
    # The rightful puller still gets exactly its pages, once.
    status, error = pull_again(local, offer, [10, 11])
    assert status is TransferStatus.DONE, error
    assert np.array_equal(local.pool[[10, 11]], seeded_pool(SEED, 128, 16 << 10)[[1, 2]])
    peer.call("revoke", transfer_id=other["transfer_id"])
    assert_idle(local, peer)
    assert sorted(holder_events(peer, 2)) == ["CANCELLED", "DONE"]
