"""One pull seen from each side, as a small state machine run by the agent's event-loop thread.

Invariant on the puller: the receive lanes have cancelled every receive of a pull (waited for)
before its handle reports the end, so once a handle has ended no byte of it can still land in the
pool (tests/integration/test_transfer_ucx.py, test_cancelled_pull_on_both_lanes_...). The holder
cannot withdraw a rendezvous request it has sent: until the puller has seen the CANCEL it may
still read those pages with cma, after the offer ended; it discards what it read, and reading
never changes the holder's memory.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from transfer.agent import MemoryRegion, PullHandle, TransferError, TransferStatus
from transfer.control import Connection, ControlMessage, MessageKind
from transfer.offer_book import OfferBook, OfferEntry
from transfer.pages import PageRun, checksum_runs, host_view
from transfer.ucx_binding import CudaPages, UcxBinding, UcxRequests
from transfer.ucx_endpoints import EndpointPool
from transfer.ucx_lanes import ReceiveJob, ReceiveLane, assign_lanes

_logger = logging.getLogger(__name__)

_SEND_WINDOW = 64  # rendezvous requests UCX's shared-memory FIFO holds (UCX_MM_FIFO_SIZE default)
# The holder's loop must progress its sends before the puller runs out of rendezvous requests to
# serve. It wakes after a quarter of the time the puller needs to copy what is posted, at a rate
# above anything a host copy reaches here (10 GB/s), between 0.1 and 5 ms; device memory: 0.1 ms.
_HOST_COPY_RATE = 10e9
_MIN_SEND_POLL_S = 0.0001
_MAX_SEND_POLL_S = 0.005
_MAX_PAGES_PER_PULL = 1 << 22  # refuse absurd page counts before expanding the runs
_PULL_WAIT_S = 10.0  # a connection that sends no PULL within this is dropped
_MAX_LANES = 16


def page_buffer(region: MemoryRegion, first_page: int, num_pages: int) -> Any:
    """The pages as a buffer UCX reads or writes in place (no staging copy)."""
    if region.device == "cpu":
        return host_view(region, first_page, num_pages)
    return CudaPages(region.address + first_page * region.page_bytes, num_pages * region.page_bytes)


class Session:
    """What both sides share: the control connection, the UCX work, the end."""

    def __init__(self, binding: UcxBinding, connection: Connection, endpoints: EndpointPool) -> None:
        self.binding = binding
        self.connection = connection
        self.endpoints = endpoints
        self.is_ended = False

    @property
    def has_posted_sends(self) -> bool:
        return False

    @property
    def send_poll_s(self) -> float:
        """How long the loop may leave this session's posted sends without progress."""
        return _MAX_SEND_POLL_S

    def release(self, notice: ControlMessage | None, is_clean: bool = False) -> None:
        """Ends UCX work, tells the peer why (if it does not know), leaves the socket to the agent."""
        self.is_ended = True
        self._stop_ucx(is_clean)
        if notice is not None:
            self.connection.send(notice)
        # The agent closes the socket once it is out of its selector, so the fd is not reused early.

    def _stop_ucx(self, is_clean: bool) -> None:
        raise NotImplementedError


class HolderSession(Session):
    """Serves one PULL on an accepted connection, sending on a pooled endpoint to the puller."""

    def __init__(
        self,
        binding: UcxBinding,
        connection: Connection,
        endpoints: EndpointPool,
        book: OfferBook,
        regions: Any,
        serve_delay_s: float = 0.0,
    ) -> None:
        super().__init__(binding, connection, endpoints)
        self._serve_delay_s = serve_delay_s  # a test hook (UcxTransferAgent)
        self._sends_after = 0.0
        self._book = book
        self._regions = regions
        self.requests = UcxRequests(binding)
        self.transfer_id: str | None = None
        self._source: MemoryRegion | None = None
        self._runs: list[PageRun] = []
        self._run_lanes: list[int] = []
        self._mean_run_bytes = 0.0
        self._lane_endpoints: list[Any] = []
        self._tag_base = 0
        self._num_posted = 0
        self._opened_at = time.monotonic()

    def on_message(self, message: ControlMessage) -> None:
        if message.kind is MessageKind.PULL and self.transfer_id is None:
            self._start(message)
        elif message.kind is MessageKind.DONE and self.transfer_id is not None:
            self.end(TransferStatus.DONE, None, notify=False)
        elif message.kind is MessageKind.CANCEL:
            self.end(_status_named(message.status), message.error or "cancelled by the puller", notify=False)
        else:
            self.end(TransferStatus.FAILED, f"unexpected {message.kind.value} message", notify=True)

    def _start(self, message: ControlMessage) -> None:
        counts = [count for _, count in message.runs]
        error = None
        if not counts or min(counts) < 1 or sum(counts) > _MAX_PAGES_PER_PULL:
            error = f"malformed page runs in the pull of transfer {message.transfer_id}"
        elif not 1 <= len(message.lane_addresses) <= _MAX_LANES or len(message.run_lanes) != len(counts):
            error = f"malformed lanes in the pull of transfer {message.transfer_id}"
        elif not all(0 <= lane < len(message.lane_addresses) for lane in message.run_lanes):
            error = f"a run names a lane that does not exist in the pull of transfer {message.transfer_id}"
        if error is not None:
            self.release(ControlMessage(MessageKind.ERROR, message.transfer_id, error=error))
            return
        page_ids = [first + offset for first, count in message.runs for offset in range(count)]
        try:
            entry = self._book.claim(
                message.transfer_id, message.secret, message.region, page_ids, message.timeout_s
            )
        except TransferError as error:
            self.release(ControlMessage(MessageKind.ERROR, message.transfer_id, error=str(error)))
            return
        self.transfer_id = message.transfer_id
        self._serve(entry, message, counts)

    def _serve(self, entry: OfferEntry, message: ControlMessage, counts: list[int]) -> None:
        region = self._regions.get(entry.region_name)
        runs = [PageRun(first, 0, count) for first, count in message.runs]
        checksum_value = None
        if message.checksum and region.device == "cpu":
            checksum_value = checksum_runs(region, runs, use_src=True)
        try:
            for address in message.lane_addresses:
                self._lane_endpoints.append(self.endpoints.acquire(bytes.fromhex(address)))
        except Exception as error:  # a bad or unreachable address from the peer
            self.end(TransferStatus.FAILED, f"cannot reach the puller's UCX worker: {error}", notify=True)
            return
        self._source, self._runs, self._tag_base = region, runs, message.tag_base
        self._run_lanes = list(message.run_lanes)
        self._mean_run_bytes = sum(counts) * region.page_bytes / len(runs)
        self._sends_after = time.monotonic() + self._serve_delay_s
        self._post_sends()
        accept = ControlMessage(
            MessageKind.ACCEPT,
            entry.transfer_id,
            worker_address=self.binding.worker_address.hex(),
            checksum_value=checksum_value,
        )
        self.connection.send(accept)

    def poll(self, now: float) -> None:
        # Completion of the sends needs no report: the puller's DONE (all receives landed) ends it.
        if self.is_ended:
            return
        if self.transfer_id is None:
            if now - self._opened_at > _PULL_WAIT_S:
                self.release(None)
            return
        self.requests.poll()
        if self.requests.error is not None:
            self.end(TransferStatus.FAILED, f"send failed: {self.requests.error}", notify=True)
        else:
            self._post_sends()

    def _post_sends(self) -> None:
        """Keeps at most _SEND_WINDOW sends outstanding: posting a thousand rendezvous sends at once
        only queues them inside UCX, where they cost on every progress."""
        assert self._source is not None
        if self._serve_delay_s and time.monotonic() < self._sends_after:
            return
        while self._num_posted < len(self._runs) and self.requests.num_pending < _SEND_WINDOW:
            run = self._runs[self._num_posted]
            buffer = page_buffer(self._source, run.src_first, run.num_pages)
            tag = self._tag_base + self._num_posted
            endpoint = self._lane_endpoints[self._run_lanes[self._num_posted]]
            self.requests.add(self.binding.send(endpoint, buffer, tag), buffer)
            self._num_posted += 1

    def on_end_of_stream(self) -> None:
        if self.transfer_id is None:
            self.release(None)
        else:
            self.end(
                TransferStatus.FAILED,
                "the puller closed the control connection (process gone?)",
                notify=False,
            )

    def end(self, status: TransferStatus, error: str | None, notify: bool) -> None:
        if self.is_ended:
            return
        notice = None
        if notify and self.transfer_id is not None:
            notice = ControlMessage(
                MessageKind.CANCEL, self.transfer_id, status=status.name, error=error or ""
            )
        self.release(notice, is_clean=status is TransferStatus.DONE)
        if self.transfer_id is not None:
            self._book.end(self.transfer_id, status)

    @property
    def has_posted_sends(self) -> bool:
        return self.requests.has_pending and not self.is_ended

    @property
    def send_poll_s(self) -> float:
        # Waking the holder more often costs the puller: on a 2-core host each wake-up preempts a
        # lane that is copying. 2 MiB pages, 100 us: 5.5 GB/s median; 5 ms: 6.6 (docs/transfer.md).
        assert self._source is not None
        if self._source.device != "cpu":
            return _MIN_SEND_POLL_S
        posted_s = self.requests.num_pending * self._mean_run_bytes / _HOST_COPY_RATE
        return min(_MAX_SEND_POLL_S, max(_MIN_SEND_POLL_S, posted_s / 4))

    def _stop_ucx(self, is_clean: bool) -> None:
        for endpoint in self._lane_endpoints:
            self.endpoints.release(endpoint, is_clean)
        self._lane_endpoints = []


class PullSession(Session):
    """Runs one pull from this side: PULL sent, receives posted, DONE once all landed.

    The runs are spread over the agent's receive lanes (transfer/ucx_lanes.py), balanced by bytes,
    and handed to them right after the PULL goes out. Each lane posts them through an endpoint of
    this pull's own, to its own worker: UCX matches tagged receives per worker, the endpoint only
    groups them, and `cancel_and_close` on it cancels exactly this pull's receives. (Closing an
    endpoint to the holder instead would also tear down the holder's endpoint paired with it,
    failing other pulls; measured with ucxx 0.52.)

    Every receive completing proves the holder accepted: it sends only after claiming the offer,
    and the tags are unique to this pull. So the ACCEPT is waited for only when it carries a
    checksum to compare; otherwise it is off the critical path (it arrived up to 0.5 ms after the
    last page of a 64 MiB pull on the 2-core host, where the puller's lanes hold both cores).
    """

    def __init__(
        self,
        binding: UcxBinding,
        connection: Connection,
        endpoints: EndpointPool,
        handle: PullHandle,
        destination: MemoryRegion,
        runs: list[PageRun],
        checksum: bool,
        deadline: float,
        lanes: list[ReceiveLane],
        wake: Any,
    ) -> None:
        super().__init__(binding, connection, endpoints)
        self._lanes = lanes
        self._wake = wake  # called by a lane thread when a job of this pull has finished
        self._jobs: list[tuple[ReceiveLane, ReceiveJob]] = []
        self.handle = handle
        self._destination = destination
        self._runs = runs
        self._checksum = checksum
        self.deadline = deadline
        self._is_accepted = False
        self._expected_checksum: int | None = None

    def start(self, message: ControlMessage) -> None:
        """Sends `message` (a PULL without lanes yet) with the lanes filled in, then hands each lane
        its receives. PULL first: the hand-off wakes the lane threads, which then compete with this
        one for the GIL (0.2-0.6 ms before the PULL went out, measured), and a rendezvous request
        that arrives before its receive is posted just waits in UCX's unexpected queue."""
        run_lanes = assign_lanes([run.num_pages for run in self._runs], len(self._lanes))
        used = sorted(set(run_lanes))
        message = dataclasses.replace(
            message,
            lane_addresses=[self._lanes[lane].worker_address.hex() for lane in used],
            run_lanes=[used.index(lane) for lane in run_lanes],
        )
        if not self.connection.send(message):
            self.end(TransferStatus.FAILED, "could not send the pull request to the holder", notify=False)
            return
        items: dict[int, list[tuple[Any, int]]] = {lane: [] for lane in used}
        num_bytes = dict.fromkeys(used, 0)
        for index, (run, lane) in enumerate(zip(self._runs, run_lanes, strict=True)):
            buffer = page_buffer(self._destination, run.dst_first, run.num_pages)
            items[lane].append((buffer, message.tag_base + index))
            num_bytes[lane] += run.num_pages * self._destination.page_bytes
        for lane in used:
            job = ReceiveJob(items[lane], num_bytes[lane], self._wake)
            self._jobs.append((self._lanes[lane], job))
            self._lanes[lane].submit(job)

    def on_message(self, message: ControlMessage) -> None:
        if message.kind is MessageKind.ACCEPT and not self._is_accepted:
            self._is_accepted = True
            self._expected_checksum = message.checksum_value
            self.handle._mark_transferring()
        elif message.kind is MessageKind.ERROR:
            self.end(TransferStatus.FAILED, f"refused by the holder: {message.error}", notify=False)
        elif message.kind is MessageKind.CANCEL:
            self.end(_status_named(message.status), message.error or "cancelled by the holder", notify=False)
        else:
            self.end(TransferStatus.FAILED, f"unexpected {message.kind.value} message", notify=True)

    def poll(self, now: float) -> None:
        if self.is_ended:
            return
        if now >= self.deadline:
            self.end(TransferStatus.TIMED_OUT, "pull ran past its timeout", notify=True)
            return
        if not all(job.is_finished for _, job in self._jobs):
            return
        error = next((job.error for _, job in self._jobs if job.error is not None), None)
        if error is not None:
            self.end(TransferStatus.FAILED, f"receive failed: {error}", notify=True)
        elif self._is_accepted or not self._checksum:  # (class docstring)
            self._complete()

    def _complete(self) -> None:
        if self._checksum and self._expected_checksum is not None:
            if checksum_runs(self._destination, self._runs, use_src=False) != self._expected_checksum:
                self.end(TransferStatus.FAILED, "checksum mismatch", notify=True)
                return
        self.handle.bytes_moved = sum(run.num_pages for run in self._runs) * self._destination.page_bytes
        self.handle.num_messages = len(self._runs)
        self.connection.send(ControlMessage(MessageKind.DONE, self.handle.transfer_id))
        self.release(None)
        self.handle._finish(TransferStatus.DONE)

    def _stop_ucx(self, is_clean: bool) -> None:
        for lane, job in self._jobs:
            if not lane.cancel(job):
                _logger.error("transfer %s: a receive lane did not cancel in time", self.handle.transfer_id)
        self._jobs = []

    def on_end_of_stream(self) -> None:
        self.end(
            TransferStatus.FAILED, "the holder closed the control connection (process gone?)", notify=False
        )

    def end(self, status: TransferStatus, error: str | None, notify: bool) -> None:
        if self.is_ended:
            return
        notice = None
        if notify:
            notice = ControlMessage(
                MessageKind.CANCEL, self.handle.transfer_id, status=status.name, error=error or ""
            )
        self.release(notice)
        self.handle._finish(status, error)


def _status_named(name: str) -> TransferStatus:
    try:
        status = TransferStatus[name]
    except KeyError:
        return TransferStatus.FAILED
    return status if status.is_final and status is not TransferStatus.DONE else TransferStatus.FAILED
