"""One pull seen from each side, as a small state machine run by the agent's event-loop thread.

Invariant on both sides: a session's UCX endpoint is closed (cancelling every request still
posted on it) before the session reports its end, so once a handle or an offer has ended no byte
of it can still land in, or be read from, the pool.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from transfer.agent import MemoryRegion, PullHandle, TransferError, TransferStatus
from transfer.control import Connection, ControlMessage, MessageKind
from transfer.offer_book import OfferBook, OfferEntry
from transfer.pages import PageRun, checksum_runs, host_view
from transfer.ucx_binding import CudaPages, UcxBinding
from transfer.ucx_endpoints import EndpointPool

_SEND_WINDOW = 32
_MAX_PAGES_PER_PULL = 1 << 22  # refuse absurd page counts before expanding the runs
_PULL_WAIT_S = 10.0  # a connection that sends no PULL within this is dropped


def page_buffer(region: MemoryRegion, first_page: int, num_pages: int) -> Any:
    """The pages as a buffer UCX reads or writes in place (no staging copy)."""
    if region.device == "cpu":
        return host_view(region, first_page, num_pages)
    return CudaPages(region.address + first_page * region.page_bytes, num_pages * region.page_bytes)


class UcxRequests:
    """Requests of one session, kept with the buffers they point into until they complete.

    Polled from the front, stopping at the first one still running: messages from one peer
    complete roughly in order, so a pull of N pages costs O(N) checks in all instead of O(N) per
    loop turn (1024 pending pages made the loop itself the bottleneck). A failure further back is
    seen once the ones before it are done; the pull's deadline bounds the wait either way.
    """

    def __init__(self, binding: UcxBinding) -> None:
        self._binding = binding
        self._pending: collections.deque[tuple[Any, Any]] = collections.deque()
        self.error: str | None = None

    def add(self, request: Any, buffer: Any) -> None:
        self._pending.append((request, buffer))

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def poll(self) -> bool:
        """True once every request has completed; the first failure is kept in `error`."""
        while self._pending:
            completed, error = self._binding.request_state(self._pending[0][0])
            if not completed:
                return False
            self._pending.popleft()
            if error is not None and self.error is None:
                self.error = error
        return True


class Session:
    """What both sides share: the control connection, the endpoint, the requests, the end."""

    def __init__(self, binding: UcxBinding, connection: Connection, endpoints: EndpointPool) -> None:
        self.binding = binding
        self.connection = connection
        self.endpoints = endpoints
        self.endpoint: Any = None
        self.requests = UcxRequests(binding)
        self.is_ended = False

    def release(self, notice: ControlMessage | None, is_clean: bool = False) -> None:
        """Ends UCX work, tells the peer why (if it does not know), leaves the socket to the agent."""
        self.is_ended = True
        if self.endpoint is not None:
            self._drop_endpoint(is_clean)
            self.endpoint = None
        if notice is not None:
            self.connection.send(notice)
        # The agent closes the socket once it is out of its selector, so the fd is not reused early.

    def _drop_endpoint(self, is_clean: bool) -> None:
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
    ) -> None:
        super().__init__(binding, connection, endpoints)
        self._book = book
        self._regions = regions
        self.transfer_id: str | None = None
        self._source: MemoryRegion | None = None
        self._runs: list[PageRun] = []
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
        if not counts or min(counts) < 1 or sum(counts) > _MAX_PAGES_PER_PULL:
            error = f"malformed page runs in the pull of transfer {message.transfer_id}"
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
        self._serve(entry, message)

    def _serve(self, entry: OfferEntry, message: ControlMessage) -> None:
        region = self._regions.get(entry.region_name)
        runs = [PageRun(first, 0, count) for first, count in message.runs]
        checksum_value = None
        if message.checksum and region.device == "cpu":
            checksum_value = checksum_runs(region, runs, use_src=True)
        try:
            self.endpoint = self.endpoints.acquire(bytes.fromhex(message.worker_address))
        except Exception as error:  # a bad or unreachable address from the peer
            self.end(TransferStatus.FAILED, f"cannot reach the puller's UCX worker: {error}", notify=True)
            return
        self._source, self._runs, self._tag_base = region, runs, message.tag_base
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
        """Keeps at most _SEND_WINDOW sends outstanding, as ucx_perftest does: posting a thousand
        rendezvous sends at once only queues them inside UCX, where they cost on every progress."""
        assert self._source is not None
        while self._num_posted < len(self._runs) and self.requests.num_pending < _SEND_WINDOW:
            run = self._runs[self._num_posted]
            buffer = page_buffer(self._source, run.src_first, run.num_pages)
            tag = self._tag_base + self._num_posted
            self.requests.add(self.binding.send(self.endpoint, buffer, tag), buffer)
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

    def _drop_endpoint(self, is_clean: bool) -> None:
        self.endpoints.release(self.endpoint, is_clean)


class PullSession(Session):
    """Runs one pull from this side: receives posted, PULL sent, DONE once ACCEPTed and all landed.

    Receives are posted before the PULL goes out, so data flows the moment the holder sends. They
    are posted through an endpoint of this pull's own, to this worker itself: UCX matches tagged
    receives per worker, the endpoint only groups them, and closing it cancels exactly this pull's
    receives. (Closing an endpoint to the holder instead would also tear down the holder's
    endpoint paired with it, failing other pulls; measured with ucxx 0.52.)
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
    ) -> None:
        super().__init__(binding, connection, endpoints)
        self.handle = handle
        self._destination = destination
        self._runs = runs
        self._checksum = checksum
        self.deadline = deadline
        self._is_accepted = False
        self._expected_checksum: int | None = None

    def start(self, message: ControlMessage) -> None:
        self.endpoint = self.endpoints.open_receive_group()
        for index, run in enumerate(self._runs):
            buffer = page_buffer(self._destination, run.dst_first, run.num_pages)
            self.requests.add(self.binding.receive(self.endpoint, buffer, message.tag_base + index), buffer)
        if not self.connection.send(message):
            self.end(TransferStatus.FAILED, "could not send the pull request to the holder", notify=False)

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
        if not self.requests.poll():
            return
        if self.requests.error is not None:
            self.end(TransferStatus.FAILED, f"receive failed: {self.requests.error}", notify=True)
        elif self._is_accepted:  # data can land before the ACCEPT, which carries the checksum
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

    def _drop_endpoint(self, is_clean: bool) -> None:
        self.endpoints.close(self.endpoint)

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
