"""Receive lanes: UCX workers of the puller that share out the receives of one pull.

Why: on one host a rendezvous message is moved by the receiver, inside its progress call
(`process_vm_readv`, UCX's cma transport). One thread copies distinct pages at about 4 GB/s on the
2-vCPU development host, two threads at about 7.5 GB/s (docs/transfer.md, "Receive lanes"), so a
pull spread over two workers progressed by two threads moves close to twice as fast. The holder
sends each run to the lane it was given in the PULL.

Lane 0 is inline: the agent's own worker, driven by the agent's loop (`step()`), so a pull on it
alone pays no hand-off between threads (up to about 1 ms on the 2-vCPU host). Every other lane
has a worker and a thread of its own, and spins only while it has receives posted; otherwise it
sleeps on an event. A lane owns its worker (a UCX worker is single-threaded): only its driving
thread posts receives, calls progress and cancels or closes endpoints. The agent's loop hands it a
`ReceiveJob` (one pull's runs on this lane) and reads back only `is_finished` and `error`.

A job's receives are posted through an endpoint of its own to the lane's own worker, so cancelling
through that endpoint cancels exactly this job's receives. `cancel` returns once the lane has done
so with ucxx's `close_blocking` (the requests end "canceled" before it returns; plain `close()`
cancels nothing, and a cancelled pull's pages were still written once the holder sent), after
which no byte of the job can land.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transfer.ucx_binding import UcxBinding, UcxRequests

_logger = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.1  # an idle lane wakes this often to notice that it was closed
_LINGER_S = 5.0  # closed endpoints (and their buffers) stay referenced while UCX finishes closing
_CANCEL_WAIT_S = 5.0


class ReceiveJob:
    """One pull's receives on one lane: (buffer, tag) pairs. Written by the lane thread once done."""

    def __init__(self, items: list[tuple[Any, int]], num_bytes: int, on_finished: Callable[[], None]) -> None:
        self.items = items
        self.num_bytes = num_bytes
        self.error: str | None = None
        self._on_finished = on_finished
        self._finished = threading.Event()
        self._cancel_requested = threading.Event()

    @property
    def is_finished(self) -> bool:
        return self._finished.is_set()

    def _finish(self, error: str | None) -> None:
        self.error = error
        self._finished.set()
        self._on_finished()


@dataclass
class _Running:
    job: ReceiveJob
    endpoint: Any
    requests: UcxRequests
    closed_at: float = field(default=0.0)


class ReceiveLane:
    """A UCX worker that receives pulls. Threaded: a thread of its own drives it. Inline
    (`threaded=False`): the thread that owns the binding (the agent's loop) calls `step()`, so a pull
    on this lane needs no hand-off between threads."""

    def __init__(self, binding: UcxBinding, name: str, threaded: bool = True) -> None:
        self.worker_address = binding.worker_address
        self._binding = binding
        self._incoming: queue.SimpleQueue[ReceiveJob] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._is_closed = False
        self._running: list[_Running] = []
        self._closing: list[_Running] = []
        # The endpoint the next job posts through, made while the lane is idle: creating one costs
        # about 0.1 ms, which a pull would otherwise wait for before its first receive is posted.
        self._spare_endpoint: Any = None
        self.bytes_received = 0  # by jobs that completed without error; written by the lane's thread
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    @property
    def is_busy(self) -> bool:
        """Receives posted or waiting to be: whoever drives the lane should keep calling step()."""
        return bool(self._running) or not self._incoming.empty()

    def submit(self, job: ReceiveJob) -> None:
        if self._is_closed:
            job._finish("the transfer agent is closed")
            return
        self._incoming.put(job)
        self._wake.set()

    def cancel(self, job: ReceiveJob) -> bool:
        """Cancels the job's receives; True once the lane has (nothing of it can land after)."""
        job._cancel_requested.set()
        if self._thread is None:  # inline: only the driving thread calls this
            self.step()
            return job.is_finished
        self._wake.set()
        if threading.current_thread() is self._thread:
            return job.is_finished
        return job._finished.wait(_CANCEL_WAIT_S)

    def close(self) -> None:
        """Cancels every job; a threaded lane stops its thread (bounded) and closes its binding."""
        self._is_closed = True
        if self._thread is None:
            self.step()
            return
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=_CANCEL_WAIT_S)

    def step(self, progress: bool = True) -> None:
        """Starts new jobs, progresses the worker while receives are posted (unless the caller just
        did: `progress=False`, the agent's loop for lane 0), ends finished jobs."""
        while not self._incoming.empty():
            started = self._start(self._incoming.get())
            if started is not None:
                self._running.append(started)
        if progress and self._running:
            self._binding.progress()
        self._running = self._reap(self._running)
        now = time.monotonic()
        self._closing = [entry for entry in self._closing if now - entry.closed_at < _LINGER_S]
        if self._is_closed:
            self._close_spare()
        elif self._spare_endpoint is None and not self._running and self._incoming.empty():
            self._spare_endpoint = self._binding.connect(self.worker_address)

    # ---- a threaded lane's thread ------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if not self._running:
                if self._is_closed and self._incoming.empty():
                    break
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
            try:
                self.step()
            except Exception:  # a bug must not stop the lane: the agent's pulls wait on it
                _logger.exception("receive lane: error in its loop")
        self._close_spare()
        self._binding.close()

    def _close_spare(self) -> None:
        if self._spare_endpoint is not None:
            endpoint, self._spare_endpoint = self._spare_endpoint, None
            self._binding.close_endpoint(endpoint)

    def _start(self, job: ReceiveJob) -> _Running | None:
        if job._cancel_requested.is_set() or self._is_closed:
            job._finish("cancelled" if not self._is_closed else "the transfer agent is closed")
            return None
        try:
            endpoint, self._spare_endpoint = self._spare_endpoint, None
            if endpoint is None:
                endpoint = self._binding.connect(self.worker_address)
            requests = UcxRequests(self._binding)
            for buffer, tag in job.items:
                requests.add(self._binding.receive(endpoint, buffer, tag), buffer)
        except Exception as error:  # UCX refused a receive: the pull fails, the lane goes on
            job._finish(f"cannot post the receives: {error}")
            return None
        return _Running(job, endpoint, requests)

    def _reap(self, running: list[_Running]) -> list[_Running]:
        still_running = []
        for entry in running:
            if self._is_closed:
                self._close(entry, "the transfer agent is closed", cancel=True)
            elif entry.job._cancel_requested.is_set():
                self._close(entry, "cancelled", cancel=True)
            elif entry.requests.poll():
                if entry.requests.error is None:
                    self.bytes_received += entry.job.num_bytes
                self._close(entry, entry.requests.error, cancel=False)
            else:
                still_running.append(entry)
        return still_running

    def _close(self, entry: _Running, error: str | None, cancel: bool) -> None:
        """`cancel`: receives may still be posted, cancel them first (no receive of the job can
        complete after this). Otherwise all completed and a plain close, which never waits, will do:
        the blocking close stays off the path of every successful pull."""
        try:
            if cancel:
                self._binding.cancel_and_close(entry.endpoint)
            else:
                self._binding.close_endpoint(entry.endpoint)
        except Exception as close_error:  # the job must end all the same, or every turn retries it
            _logger.exception("receive lane: closing a pull's endpoint failed")
            if cancel:
                error = f"{error}; cancelling its receives failed ({close_error})"
        entry.closed_at = time.monotonic()
        self._closing.append(entry)
        entry.job._finish(error)


def assign_lanes(run_bytes: list[int], num_lanes: int) -> list[int]:
    """The lane of each run: each goes to the lane with the fewest bytes so far (ties: lowest)."""
    loads = [0] * num_lanes
    lanes = []
    for num_bytes in run_bytes:
        lane = min(range(num_lanes), key=lambda index: (loads[index], index))
        loads[lane] += num_bytes
        lanes.append(lane)
    return lanes
