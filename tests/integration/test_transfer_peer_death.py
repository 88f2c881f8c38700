"""A peer killed mid-transfer must not stall or leak on the side that survives: real processes,
real UCX on loopback (the shared fixtures and sides are test_transfer_ucx.py's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.integration.test_transfer_ucx import SEED, LocalSide, assert_idle
from tests.integration.test_transfer_ucx import binding as binding  # autouse: once per UCX binding
from tests.transfer_helpers import PeerProcess, seeded_pool
from transfer import PullHandle, TransferStatus

pytestmark = pytest.mark.timeout(30)


def assert_another_process_is_served(holder: LocalSide, page_bytes: int) -> None:
    """A healthy puller in another process, as in a deployment, gets every byte of pages 5-7."""
    peer = PeerProcess(8, page_bytes, seed=99)
    try:
        offer = holder.agent.offer("kv", [5, 6, 7], 30.0)
        result = peer.call(
            "pull",
            timeout_s=15.0,  # our wait for the answer; the pull itself is bounded at 10 s
            address=offer.address,
            transfer_id=offer.transfer_id,
            secret=offer.secret,
            src_page_ids=[5, 6, 7],
            dst_page_ids=[0, 1, 2],
            checksum=True,  # the bytes that landed are the holder's (CRC-32 on both sides)
        )
        assert result == {"status": "DONE", "error": None}
    finally:
        peer.kill()


def test_puller_killed_mid_transfer_fails_within_bound_and_frees_the_holder() -> None:
    """This process holds 128 MiB; a helper pulls it and dies the moment the holder has accepted.
    The holder's transfer must end FAILED within its bound (the control connection's end of
    stream), its pages be released, and the holder go on serving. The holder posts its sends
    0.2 s after accepting (the agent's test hook): without it a fast host could finish all
    128 MiB and send DONE before the puller's watcher thread ran, so the puller died after its
    transfer rather than during it (seen once in CI on a loaded 2-core host)."""
    holder = LocalSide(128, 1 << 20, serve_delay_s=0.2)
    holder.pool[:] = seeded_pool(SEED, 128, 1 << 20)
    ended: list[TransferStatus] = []
    puller = None
    try:
        for attempt in range(3):
            puller = PeerProcess(128, 1 << 20, seed=attempt)
            offer = holder.agent.offer("kv", list(range(128)), 30.0, lambda _, status: ended.append(status))
            start = time.monotonic()
            puller.pull_then_die(offer, 128)
            deadline = time.monotonic() + 5.0
            while len(ended) <= attempt and time.monotonic() < deadline:
                time.sleep(0.01)
            assert ended[attempt:] == [TransferStatus.FAILED]  # not DONE: it died before its DONE
            assert time.monotonic() - start < 5.0
            assert_idle(holder, None)
        assert_another_process_is_served(holder, 1 << 20)  # the holder still serves
        assert ended == [TransferStatus.FAILED] * 3
        assert_idle(holder, None)
    finally:
        holder.agent.close()
        if puller is not None:
            puller.kill()


def test_a_peer_killed_while_writing_to_the_holder_does_not_stall_it() -> None:
    """The cause of the old dead-receive bug (docs/transfer.md, "A killed peer must not stall the
    survivor"): a peer killed between claiming a slot of the holder worker's shared-memory FIFO
    and marking it ready left the worker receiving nothing ever again, so a fresh puller's
    endpoint never got its wire-up reply and the pull timed out (a puller whose endpoint was
    pooled before was still served). The helper dies at exactly that point, every time, over
    posix/sysv; no context of ours may use them, so a fresh puller, here and in another
    process, must still be served."""
    holder = LocalSide(8, 64 << 10)
    holder.pool[:] = seeded_pool(SEED, 8, 64 << 10)
    veteran = LocalSide(8, 64 << 10)
    fresh = LocalSide(8, 64 << 10)
    saboteur = None

    def pull_into(puller: LocalSide) -> PullHandle:
        offer = holder.agent.offer("kv", [5, 6, 7], 30.0)
        return puller.agent.pull(
            offer.address,
            offer.transfer_id,
            offer.secret,
            "kv",
            [5, 6, 7],
            "kv",
            [0, 1, 2],
            5.0,
            checksum=True,
        )

    try:
        handle = pull_into(veteran)  # its endpoint is pooled in the holder from now on
        assert handle.wait(6.0) is TransferStatus.DONE, handle.error
        saboteur = subprocess.Popen(
            [sys.executable, "-m", "tests.fifo_saboteur", holder.agent.worker_address.hex()],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "UCX_HANDLE_ERRORS": "none", "UCX_WARN_UNUSED_ENV_VARS": "n"},
        )
        assert saboteur.stdout is not None
        assert json.loads(saboteur.stdout.readline()) == {"sent": True, "error": None}
        assert saboteur.wait(timeout=15.0) in (-signal.SIGSEGV, -signal.SIGKILL)

        handle = pull_into(fresh)
        assert handle.wait(6.0) is TransferStatus.DONE, (handle.status, handle.error)
        assert np.array_equal(fresh.pool[:3], holder.pool[5:8])
        assert_another_process_is_served(holder, 64 << 10)
        for side in (holder, veteran, fresh):
            assert_idle(side, None)
    finally:
        if saboteur is not None and saboteur.poll() is None:
            os.kill(saboteur.pid, signal.SIGKILL)
            saboteur.wait(timeout=10)
        for side in (fresh, veteran, holder):
            side.agent.close()
