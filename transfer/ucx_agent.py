"""UcxTransferAgent: pulls pages between processes with UCX tagged messages, zero-copy at both ends.

One thread owns the control listener and connections (a selector), the agent's UCX worker (it
calls progress), the sessions and every deadline. Pulls receive on the agent's receive lanes
(transfer/ucx_lanes.py): lane 0 is the agent's own worker, driven by this loop; each further lane
is a UCX worker with a thread of its own, so that the copies of one pull run on several cores.
Public methods are thread-safe: they validate, then hand the loop a command and wake it; `revoke`,
`cancel` and `close` wait (bounded) until the loop has done it, so stats are exact when they return.

The loop spins while lane 0 has receives posted (UCX moves data only inside progress calls). While
only sends are posted it waits between progress calls, 0.1 to 5 ms (`HolderSession.send_poll_s`):
a holder's sends need progress only to push queued rendezvous requests and to see the puller's
acknowledgements, while the copy runs in the puller's lanes and needs the cores (on a 2-core host
a spinning holder took one from them, and frequent wake-ups preempt them). Otherwise the loop
sleeps in the selector: a 5 ms tick drives the sessions' deadlines; with no session it sleeps until the
next offer lease lapses, at most 100 ms. Any wait ends early on a control
message, a command or a lane that finished a job.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

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
from transfer.control import Connection, ControlMessage, MessageKind, ProtocolError
from transfer.net_devices import interface_of
from transfer.offer_book import OfferBook
from transfer.pages import RegionTable, plan_pull
from transfer.ucx_binding import UcxBinding, load_binding
from transfer.ucx_endpoints import EndpointPool
from transfer.ucx_lanes import ReceiveLane
from transfer.ucx_sessions import HolderSession, PullSession, Session

_logger = logging.getLogger(__name__)
_IDLE_TICK_S = 0.005  # while sessions run: their deadlines
# With no session the loop has nothing to time but offer leases (waited for exactly) and its own
# beat for the watchdog; a 5 ms tick there woke a thread 200 times a second in a generation worker
# that decodes on both cores (docs/transfer.md, "An idle agent sleeps").
_QUIET_TICK_S = 0.1
_COMMAND_WAIT_S = 5.0
_CONNECT_TIMEOUT_S = 2.0


def default_lanes() -> int:
    return min(2, os.cpu_count() or 1)


class UcxTransferAgent(TransferAgent):
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        binding: str | None = None,
        advertise_host: str | None = None,
        lanes: int | None = None,
        lane_split_bytes: int = 4 << 20,
        serve_delay_s: float = 0.0,
    ) -> None:
        """Listens for pulls on host:port (loopback unless told otherwise; port 0 picks a free one).

        Peers reach this agent at `advertise_host` (default: `host`, or the host name when `host`
        is a wildcard). A specific `host` also keeps UCX's network transports to the interface
        holding it, unless UCX_NET_DEVICES says otherwise. `lanes` is the number of receive lanes
        (threads copying one pull in parallel); default 2, or 1 on a single-core host. A pull
        uses one lane per `lane_split_bytes` it moves (at least one, at most `lanes`): handing
        work to a lane thread costs about 1 ms here, as long as copying 4 MiB (0: always all).
        `binding` is the UCX Python binding, "ucxx" or "ucp" (default: BEAMSPLIT_UCX_BINDING, else
        whichever is installed, ucxx first). `serve_delay_s` is a test hook: the holder waits that
        long after accepting a PULL before it posts its sends (0 in any deployment).
        """
        num_lanes = default_lanes() if lanes is None else lanes
        if not 1 <= num_lanes <= 16:
            raise ValueError(f"lanes must be between 1 and 16, got {num_lanes}")
        net_devices = None if "UCX_NET_DEVICES" in os.environ else interface_of(host)
        self._binding: UcxBinding = load_binding(binding, net_devices)
        # Lane 0 is the agent's own worker, driven by the loop; the others have threads of their own.
        self._lanes = [ReceiveLane(self._binding, "ucx-lane-0", threaded=False)] + [
            ReceiveLane(load_binding(self._binding.name, net_devices), f"ucx-lane-{index}")
            for index in range(1, num_lanes)
        ]
        self._lane_split_bytes = lane_split_bytes
        self._serve_delay_s = serve_delay_s
        self._loop_beat = time.monotonic()  # the loop's last turn: the health watchdog reads it
        self._listener = socket.create_server((host, port))
        self._listener.setblocking(False)
        is_wildcard = host in ("", "0.0.0.0", "::")
        advertised = advertise_host or (socket.gethostname() if is_wildcard else host)
        self.address = f"{advertised}:{self._listener.getsockname()[1]}"
        self._regions = RegionTable()
        self._book = OfferBook(self.address, self._regions)
        self._selector = selectors.DefaultSelector()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)  # a full buffer already holds a wake-up: never block on it
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_reader, selectors.EVENT_READ, None)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._sessions: dict[int, Session] = {}  # by control socket fd
        self._endpoints = EndpointPool(self._binding)
        self._tags = itertools.count(secrets.randbits(24))  # unguessable start; unique per agent
        self._lock = threading.Lock()
        self._is_closed = False
        self._thread = threading.Thread(target=self._run, name=f"ucx-agent-{self.address}", daemon=True)
        self._thread.start()

    @property
    def binding_name(self) -> str:
        """The UCX Python binding in use: "ucxx" or "ucp"."""
        return self._binding.name

    @property
    def worker_address(self) -> bytes:
        """The UCX address of the agent's own worker (it sends a holder's pages; receive lane 0)."""
        return self._binding.worker_address

    # ---- holder side -------------------------------------------------------------------------
    def register(self, name: str, region: MemoryRegion) -> None:
        self._regions.register(name, region)

    def num_pages_pulled(self, transfer_id: str) -> int:
        return self._book.num_pages_claimed(transfer_id)

    def offer(self, region: str, page_ids: list[int], ttl_s: float, on_done: OnDone | None = None) -> Offer:
        self._check_open()
        return self._book.create(region, page_ids, ttl_s, on_done)

    def extend(self, transfer_id: str, ttl_s: float) -> bool:
        return self._book.extend(transfer_id, ttl_s)

    def revoke(self, transfer_id: str) -> None:
        self._call_in_loop(
            lambda: self._end_offer(transfer_id, TransferStatus.CANCELLED, "revoked by the holder")
        )

    # ---- puller side -------------------------------------------------------------------------
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
        handle = PullHandle(transfer_id, 0, lambda: self._call_in_loop(lambda: self._cancel_pull(handle)))
        try:
            self._check_open()
            destination, runs = plan_pull(self._regions, dst_region, src_page_ids, dst_page_ids, checksum)
        except TransferError as error:
            handle._finish(TransferStatus.FAILED, str(error))
            return handle
        handle.reserved_bytes = len(dst_page_ids) * destination.page_bytes
        message = ControlMessage(
            MessageKind.PULL,
            transfer_id,
            secret=secret,
            region=src_region,
            runs=[(run.src_first, run.num_pages) for run in runs],
            tag_base=next(self._tags) << 32,  # tags must be unique per worker; run index below
            timeout_s=timeout_s,
            checksum=checksum,
        )
        deadline = time.monotonic() + timeout_s
        self._post(
            lambda: self._start_pull(peer_address, handle, destination, runs, checksum, deadline, message)
        )
        return handle

    @property
    def num_lanes(self) -> int:
        return len(self._lanes)

    def lane_bytes(self) -> list[int]:
        """Bytes each receive lane has received for pulls that completed (for tests and metrics)."""
        return [lane.bytes_received for lane in self._lanes]

    def loop_age_s(self) -> float:
        """Seconds since the event loop last came round; a wedged loop (a UCX call that never
        returns) grows it without bound, an idle one keeps it under a few milliseconds."""
        return time.monotonic() - self._loop_beat

    def stall_loop_for_test(self, seconds: float) -> None:
        """Test hook: blocks the event loop for `seconds`, as a wedged UCX call would."""
        self._post(lambda: time.sleep(seconds))

    def stats(self) -> AgentStats:
        with self._lock:
            sessions = list(self._sessions.values())
        pulls = [s for s in sessions if isinstance(s, PullSession) and not s.is_ended]
        served = [
            s
            for s in sessions
            if isinstance(s, HolderSession) and s.transfer_id is not None and not s.is_ended
        ]
        pull_bytes = sum(session.handle.reserved_bytes for session in pulls)
        return AgentStats(
            len(pulls) + len(served), self._book.num_offers(), self._book.reserved_bytes() + pull_bytes
        )

    def close(self) -> None:
        """Cancels every live pull and offer (telling the peers), then stops the loop."""
        if self._is_closed:
            return
        self._call_in_loop(self._shutdown)
        self._is_closed = True
        self._post(lambda: None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=_COMMAND_WAIT_S)

    # ---- plumbing between callers and the loop -----------------------------------------------
    def _check_open(self) -> None:
        if self._is_closed:
            raise TransferError("the transfer agent is closed")

    def _post(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_writer.send(b"\0")
        except BlockingIOError:
            pass  # the buffer is full of wake-ups the loop has not read yet: it will wake
        except OSError:
            pass  # the loop has stopped (a posted command will never run; callers' waits are bounded)

    def _call_in_loop(self, command: Callable[[], None]) -> None:
        if threading.current_thread() is self._thread:
            command()  # e.g. revoke() from an on_done callback
            return
        finished = threading.Event()

        def run_then_signal() -> None:
            try:
                command()
            finally:
                finished.set()

        self._post(run_then_signal)
        finished.wait(_COMMAND_WAIT_S)

    # ---- everything below runs on the loop thread --------------------------------------------
    def _run(self) -> None:
        while not (self._is_closed and self._commands.empty()):
            self._loop_beat = time.monotonic()
            try:
                for key, _ in self._selector.select(self._wait_s()):
                    self._on_readable(key)
                while not self._commands.empty():
                    self._commands.get()()
                self._binding.progress()  # the holder's sends and lane 0's receives alike
                self._lanes[0].step(progress=False)
                self._poll_sessions(time.monotonic())
            except Exception:  # a bug must not stop the loop: every other transfer depends on it
                _logger.exception("transfer agent %s: error in the event loop", self.address)
        for lane in self._lanes:
            lane.close()
        self._selector.close()
        self._listener.close()
        self._wake_reader.close()
        self._wake_writer.close()
        self._binding.close()

    def _wait_s(self) -> float:
        """How long the loop may wait for control traffic before it must call progress again.

        UCX moves data only inside progress calls: none while our lane has receives posted; while
        only sends are, what the sessions allow (sub-millisecond waits sleep here, since the
        selector counts in whole milliseconds); otherwise the idle tick."""
        if self._lanes[0].is_busy:
            return 0.0
        with self._lock:
            has_sessions = bool(self._sessions)
            sending = [session.send_poll_s for session in self._sessions.values() if session.has_posted_sends]
        if not sending:
            if has_sessions:
                return _IDLE_TICK_S
            # Nothing in flight: sleep until the next offer's lease lapses, at most the quiet tick.
            next_deadline = self._book.next_deadline()
            if next_deadline is None:
                return _QUIET_TICK_S
            return min(_QUIET_TICK_S, max(0.0, next_deadline - time.monotonic()))
        wait_s = min(sending)
        if wait_s < 0.001:
            time.sleep(wait_s)
            return 0.0
        return wait_s

    def _on_readable(self, key: selectors.SelectorKey) -> None:
        if key.fileobj is self._wake_reader:
            while True:
                try:
                    if not self._wake_reader.recv(4096):
                        break
                except BlockingIOError:
                    break
        elif key.fileobj is self._listener:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            self._add_session(
                HolderSession(
                    self._binding,
                    Connection(sock),
                    self._endpoints,
                    self._book,
                    self._regions,
                    self._serve_delay_s,
                )
            )
        else:
            self._on_control_data(key.data)

    def _on_control_data(self, session: Session) -> None:
        assert isinstance(session, (HolderSession, PullSession))
        try:
            messages, has_ended = session.connection.receive()
        except ProtocolError as error:
            session.end(TransferStatus.FAILED, str(error), notify=True)
            return
        for message in messages:
            if not session.is_ended:
                try:
                    session.on_message(message)
                except Exception as error:  # contain a failure to its own transfer
                    _logger.exception("transfer agent %s: session failed", self.address)
                    session.end(TransferStatus.FAILED, f"internal error: {error}", notify=True)
        if has_ended and not session.is_ended:
            session.on_end_of_stream()

    def _add_session(self, session: Session) -> None:
        self._selector.register(session.connection.sock, selectors.EVENT_READ, session)
        with self._lock:
            self._sessions[session.connection.sock.fileno()] = session

    def _poll_sessions(self, now: float) -> None:
        with self._lock:
            sessions = list(self._sessions.items())
        for transfer_id in self._book.expired_ids(now):
            self._end_offer(transfer_id, TransferStatus.TIMED_OUT, "offer lease lapsed")
        for fileno, session in sessions:
            assert isinstance(session, (HolderSession, PullSession))
            try:
                session.poll(now)
            except Exception as error:  # contain a failure to its own transfer
                _logger.exception("transfer agent %s: session failed", self.address)
                session.end(TransferStatus.FAILED, f"internal error: {error}", notify=True)
            if session.is_ended:
                self._forget(fileno, session)
        self._endpoints.sweep(now)

    def _forget(self, fileno: int, session: Session) -> None:
        try:
            self._selector.unregister(session.connection.sock)
        except (KeyError, ValueError):
            pass  # never registered: the connection failed before
        session.connection.close()
        with self._lock:
            self._sessions.pop(fileno, None)

    def _start_pull(
        self,
        peer_address: str,
        handle: PullHandle,
        destination: MemoryRegion,
        runs: Any,
        checksum: bool,
        deadline: float,
        message: ControlMessage,
    ) -> None:
        if handle.status.is_final:
            return  # cancelled before the loop got to it
        try:
            self._connect_pull(peer_address, handle, destination, runs, checksum, deadline, message)
        except Exception as error:  # never leave a handle pending because the loop hit a bug
            _logger.exception("transfer agent %s: pull failed to start", self.address)
            handle._finish(TransferStatus.FAILED, f"internal error: {error}")

    def _connect_pull(
        self,
        peer_address: str,
        handle: PullHandle,
        destination: MemoryRegion,
        runs: Any,
        checksum: bool,
        deadline: float,
        message: ControlMessage,
    ) -> None:
        host, _, port = peer_address.rpartition(":")
        try:
            sock = socket.create_connection(
                (host, int(port)), timeout=min(_CONNECT_TIMEOUT_S, max(0.01, deadline - time.monotonic()))
            )
        except (OSError, ValueError) as error:
            handle._finish(TransferStatus.FAILED, f"cannot connect to holder {peer_address}: {error}")
            return
        session = PullSession(
            self._binding,
            Connection(sock),
            self._endpoints,
            handle,
            destination,
            runs,
            checksum,
            deadline,
            self._lanes_for(sum(run.num_pages for run in runs) * destination.page_bytes),
            self._wake,
        )
        self._add_session(session)
        session.start(message)

    def _lanes_for(self, num_bytes: int) -> list[ReceiveLane]:
        if self._lane_split_bytes <= 0:
            return self._lanes
        return self._lanes[: max(1, min(len(self._lanes), num_bytes // self._lane_split_bytes))]

    def _cancel_pull(self, handle: PullHandle) -> None:
        for session in self._live_sessions():
            if isinstance(session, PullSession) and session.handle is handle:
                session.end(TransferStatus.CANCELLED, "cancelled by the puller", notify=True)
                return
        handle._finish(TransferStatus.CANCELLED, "cancelled by the puller")

    def _end_offer(self, transfer_id: str, status: TransferStatus, error: str) -> None:
        for session in self._live_sessions():
            if isinstance(session, HolderSession) and session.transfer_id == transfer_id:
                session.end(status, error, notify=True)
                return
        self._book.end(transfer_id, status)

    def _live_sessions(self) -> list[Session]:
        with self._lock:
            return [session for session in self._sessions.values() if not session.is_ended]

    def _shutdown(self) -> None:
        for session in self._live_sessions():
            assert isinstance(session, (HolderSession, PullSession))
            session.end(TransferStatus.CANCELLED, "agent closed", notify=True)
        for transfer_id in self._book.live_ids():
            self._book.end(transfer_id, TransferStatus.CANCELLED)
        self._poll_sessions(time.monotonic())
        self._endpoints.close_all()
