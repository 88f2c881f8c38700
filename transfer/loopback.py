"""In-process TransferAgent with the UCX agent's semantics, for unit tests.

Agents find each other through a LoopbackHub instead of the network; bytes move with memmove.
`hub.stall(address)` makes a holder accept pulls and never send, the way a hung peer would, so
timeouts and cancels can be exercised. A timer thread per agent ends lapsed offers and pulls past
their bound even when no call arrives.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from dataclasses import dataclass

from transfer.agent import (
    AgentStats,
    MemoryRegion,
    Offer,
    OnDone,
    PullHandle,
    TransferAgent,
    TransferError,
    TransferStatus,
)
from transfer.offer_book import OfferBook
from transfer.pages import PageRun, RegionTable, checksum_runs, plan_pull

_TICK_S = 0.005


@dataclass
class _LoopbackPull:
    handle: PullHandle
    holder: LoopbackTransferAgent | None
    deadline: float


class LoopbackHub:
    """The address book of in-process agents."""

    def __init__(self) -> None:
        self._agents: dict[str, LoopbackTransferAgent] = {}
        self._stalled: set[str] = set()
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def add(self, agent: LoopbackTransferAgent) -> str:
        with self._lock:
            address = f"loopback:{next(self._counter)}"
            self._agents[address] = agent
            return address

    def remove(self, address: str) -> None:
        with self._lock:
            self._agents.pop(address, None)

    def find(self, address: str) -> LoopbackTransferAgent | None:
        with self._lock:
            return self._agents.get(address)

    def stall(self, address: str, is_stalled: bool = True) -> None:
        with self._lock:
            (self._stalled.add if is_stalled else self._stalled.discard)(address)

    def is_stalled(self, address: str) -> bool:
        with self._lock:
            return address in self._stalled


class LoopbackTransferAgent(TransferAgent):
    def __init__(self, hub: LoopbackHub) -> None:
        self._hub = hub
        self.address = hub.add(self)
        self._regions = RegionTable()
        self._book = OfferBook(self.address, self._regions)
        self._pulls: dict[str, _LoopbackPull] = {}  # this agent's pulls, by transfer id
        self._served: dict[str, LoopbackTransferAgent] = {}  # offers of ours being pulled -> puller
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._timer = threading.Thread(target=self._run_timer, name=f"{self.address}-timer", daemon=True)
        self._timer.start()

    def register(self, name: str, region: MemoryRegion) -> None:
        self._regions.register(name, region)

    def num_pages_pulled(self, transfer_id: str) -> int:
        return self._book.num_pages_claimed(transfer_id)

    def offer(self, region: str, page_ids: list[int], ttl_s: float, on_done: OnDone | None = None) -> Offer:
        return self._book.create(region, page_ids, ttl_s, on_done)

    def extend(self, transfer_id: str, ttl_s: float) -> bool:
        return self._book.extend(transfer_id, ttl_s)

    def revoke(self, transfer_id: str) -> None:
        self._end_offer(transfer_id, TransferStatus.CANCELLED, "revoked by the holder")

    def pull(
        self,
        peer_address: str,
        transfer_id: str,
        secret: str,
        src_region: str,
        src_page_ids: list[int],
        dst_region: str,
        dst_page_ids: list[int],
        timeout_s: float,
        checksum: bool = False,
    ) -> PullHandle:
        handle = PullHandle(
            transfer_id,
            0,
            lambda: self._end_pull(transfer_id, TransferStatus.CANCELLED, "cancelled by the puller"),
        )
        try:
            destination, runs = plan_pull(self._regions, dst_region, src_page_ids, dst_page_ids, checksum)
        except TransferError as error:
            handle._finish(TransferStatus.FAILED, str(error))
            return handle
        holder = self._hub.find(peer_address)
        if holder is None:
            handle._finish(TransferStatus.FAILED, f"no agent at {peer_address}")
            return handle
        handle.reserved_bytes = len(dst_page_ids) * destination.page_bytes
        with self._lock:
            if transfer_id in self._pulls:
                handle._finish(TransferStatus.FAILED, f"transfer {transfer_id} is already being pulled here")
                return handle
            self._pulls[transfer_id] = _LoopbackPull(handle, None, time.monotonic() + timeout_s)
        try:
            source_region = holder._serve(self, transfer_id, secret, src_region, src_page_ids, timeout_s)
        except TransferError as error:
            self._end_pull(transfer_id, TransferStatus.FAILED, str(error), notify_holder=False)
            return handle
        with self._lock:
            self._pulls[transfer_id].holder = holder
        handle._mark_transferring()
        if not self._hub.is_stalled(peer_address):
            self._copy(handle, source_region, destination, runs, checksum, holder)
        return handle

    def _copy(
        self,
        handle: PullHandle,
        source: MemoryRegion,
        destination: MemoryRegion,
        runs: list[PageRun],
        checksum: bool,
        holder: LoopbackTransferAgent,
    ) -> None:
        expected = checksum_runs(source, runs, use_src=True) if checksum else 0
        for run in runs:
            num_bytes = run.num_pages * destination.page_bytes
            ctypes.memmove(
                destination.address + run.dst_first * destination.page_bytes,
                source.address + run.src_first * source.page_bytes,
                num_bytes,
            )
            handle.bytes_moved += num_bytes
            handle.num_messages += 1
        if checksum and checksum_runs(destination, runs, use_src=False) != expected:
            self._end_pull(handle.transfer_id, TransferStatus.FAILED, "checksum mismatch")
            return
        self._end_pull(handle.transfer_id, TransferStatus.DONE, None)

    def _serve(
        self,
        puller: LoopbackTransferAgent,
        transfer_id: str,
        secret: str,
        region_name: str,
        page_ids: list[int],
        timeout_s: float,
    ) -> MemoryRegion:
        """Holder side of a pull: claim the offer for this puller, return the source region."""
        self._book.claim(transfer_id, secret, region_name, page_ids, timeout_s)
        with self._lock:
            self._served[transfer_id] = puller
        return self._regions.get(region_name)

    def _end_pull(
        self, transfer_id: str, status: TransferStatus, error: str | None, notify_holder: bool = True
    ) -> None:
        with self._lock:
            pull = self._pulls.pop(transfer_id, None)
        if pull is None:
            return
        pull.handle._finish(status, error)
        if notify_holder and pull.holder is not None:
            pull.holder._end_offer(transfer_id, status, error)

    def _end_offer(self, transfer_id: str, status: TransferStatus, error: str | None) -> None:
        with self._lock:
            puller = self._served.pop(transfer_id, None)
        self._book.end(transfer_id, status)
        if puller is not None:
            puller._end_pull(transfer_id, status, error, notify_holder=False)

    def _run_timer(self) -> None:
        while not self._stopping.wait(_TICK_S):
            now = time.monotonic()
            for transfer_id in self._book.expired_ids(now):
                self._end_offer(transfer_id, TransferStatus.TIMED_OUT, "offer lease lapsed")
            with self._lock:
                late = [tid for tid, pull in self._pulls.items() if pull.deadline <= now]
            for transfer_id in late:
                self._end_pull(transfer_id, TransferStatus.TIMED_OUT, "pull ran past its timeout")

    def stats(self) -> AgentStats:
        with self._lock:
            num_pulls = len(self._pulls)
            num_served = len(self._served)
            pull_bytes = sum(pull.handle.reserved_bytes for pull in self._pulls.values())
        return AgentStats(
            num_pulls + num_served, self._book.num_offers(), self._book.reserved_bytes() + pull_bytes
        )

    def close(self) -> None:
        """Cancels everything still live, both as holder and as puller, then leaves the hub."""
        with self._lock:
            pull_ids = list(self._pulls)
        for transfer_id in pull_ids:
            self._end_pull(transfer_id, TransferStatus.CANCELLED, "agent closed")
        for transfer_id in self._book.live_ids():
            self._end_offer(transfer_id, TransferStatus.CANCELLED, "holder closed")
        self._stopping.set()
        if threading.current_thread() is not self._timer:
            self._timer.join(timeout=1.0)
        self._hub.remove(self.address)
