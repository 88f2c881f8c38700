"""Soak check for the fixed dead-receive bug of docs/transfer.md ("A killed peer must not stall
the survivor"): pullers killed mid-transfer must never leave a holder unable to serve a puller whose
endpoint it creates fresh. Not a test: before the fix the hang came once in about 20 to 30 rounds
(a peer killed inside a UCX shared-memory FIFO write); `tests/fifo_saboteur.py` makes that happen
every time and is the regression test.

    PYTHONPATH=. BEAMSPLIT_UCX_BINDING=ucxx python scripts/repro_dead_receive.py [ROUNDS] [KILLS]

Each round: KILLS helper processes pull 128 MiB from a holder in this process and SIGKILL
themselves once the holder accepted; then a new agent in this process pulls 3 pages. On the
first failure it prints which pullers the old holder still serves.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from tests.transfer_helpers import PeerProcess, seeded_pool
from transfer import MemoryRegion, TransferStatus, UcxTransferAgent

PAGE_BYTES = 1 << 20


def agent_with_pool(num_pages: int) -> tuple[UcxTransferAgent, np.ndarray]:
    pool = np.zeros((num_pages, PAGE_BYTES), dtype=np.uint8)
    agent = UcxTransferAgent()
    agent.register("kv", MemoryRegion(pool.ctypes.data, PAGE_BYTES, num_pages))
    return agent, pool


def pull(puller: UcxTransferAgent, holder: UcxTransferAgent) -> str:
    offer = holder.offer("kv", [5, 6, 7], 30.0)
    handle = puller.pull(
        offer.address, offer.transfer_id, offer.secret, "kv", [5, 6, 7], "kv", [0, 1, 2], 5.0
    )
    return handle.wait(6.0).name


def peer_pull(peer: PeerProcess, holder: UcxTransferAgent) -> str:
    offer = holder.offer("kv", [5, 6, 7], 30.0)
    answer = peer.call(
        "pull",
        timeout_s=15.0,
        address=offer.address,
        transfer_id=offer.transfer_id,
        secret=offer.secret,
        src_page_ids=[5, 6, 7],
        dst_page_ids=[0, 1, 2],
    )
    return str(answer["status"])


def main(num_rounds: int, num_kills: int) -> None:
    holder, holder_pool = agent_with_pool(128)
    holder_pool[:] = seeded_pool(1, 128, PAGE_BYTES)
    veteran = PeerProcess(8, PAGE_BYTES, seed=7)  # pulls before any kill: its endpoint is pooled
    print("veteran before the kills:", peer_pull(veteran, holder), flush=True)
    for round_index in range(num_rounds):
        for attempt in range(num_kills):
            victim = PeerProcess(128, PAGE_BYTES, seed=attempt)
            offer = holder.offer("kv", list(range(128)), 30.0)
            victim.pull_then_die(offer, 128)
            for pipe in (victim.process.stdin, victim.process.stdout):
                if pipe is not None:
                    pipe.close()
        puller, _ = agent_with_pool(8)
        status = pull(puller, holder)
        num_fds = len(os.listdir("/proc/self/fd"))
        print(f"round {round_index}: new in-process puller {status} ({num_fds} open files)", flush=True)
        if status != TransferStatus.DONE.name:
            fresh_holder, _ = agent_with_pool(8)
            print("fresh holder -> fresh in-process puller:", pull(puller, fresh_holder))
            print("old holder, as a puller, from a fresh holder:", pull(holder, fresh_holder))
            fresh_peer = PeerProcess(8, PAGE_BYTES, seed=5)
            print("old holder -> fresh out-of-process puller:", peer_pull(fresh_peer, holder))
            print("old holder -> veteran out-of-process puller:", peer_pull(veteran, holder), flush=True)
            fresh_peer.kill()
            fresh_holder.close()
            puller.close()
            break
        puller.close()
    veteran.kill()
    holder.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40, int(sys.argv[2]) if len(sys.argv) > 2 else 3)
