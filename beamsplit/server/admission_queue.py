"""A worker's bounded admission queue: a request whose KV blocks do not fit now waits its turn.

Rules (first come first served, no overtaking, every wait bounded):
- a request is admitted at once when nobody waits and `try_admit` succeeds;
- otherwise it joins the queue if fewer than `max_queued_requests` wait, else it is refused at
  once (`QueueFullError`): the coordinator then tries another worker;
- only the head of the queue retries `try_admit`, every `poll_interval_s` and whenever the head
  changes, until it is admitted, its wait passes `max_wait_s` (`QueueTimeoutError`), or
  `stop_reason` answers (cancel, deadline, shutdown), which is raised as is;
- leaving, for whatever reason, only takes the request's ticket out: a queued request holds no
  KV block, so nothing else is freed.
`try_admit` answers None for "not now" and raises for "never" (a request larger than the pool).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

Admitted = TypeVar("Admitted")


@dataclass(frozen=True)
class AdmissionLimits:
    max_queued_requests: int = 64  # 0: never queue, refuse what does not fit at once
    max_wait_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, got {self.max_wait_s}")


class AdmissionRefusedError(RuntimeError):
    """The queue cannot take or keep the request; the message names the limit."""


class QueueFullError(AdmissionRefusedError):
    pass


class QueueTimeoutError(AdmissionRefusedError):
    pass


class AdmissionQueue:
    def __init__(
        self,
        limits: AdmissionLimits,
        what: str = "KV blocks",
        on_change: Callable[[int], None] | None = None,
        poll_interval_s: float = 0.05,
    ) -> None:
        """`what`: what the queue waits for, for messages; `on_change(num_waiting)`: a gauge."""
        self.limits = limits
        self._what = what
        self._on_change = on_change
        self._poll_interval_s = poll_interval_s
        self._tickets: deque[object] = deque()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._tickets)

    def admit(
        self,
        try_admit: Callable[[], Admitted | None],
        stop_reason: Callable[[], Exception | None],
        while_waiting: Callable[[], None] = lambda: None,
    ) -> Admitted:
        """`try_admit`'s first non-None answer; `while_waiting` runs on every turn of the wait
        (a caller keeps leases alive there; what it raises ends the wait)."""
        with self._lock:
            is_nobody_waiting = not self._tickets
        if is_nobody_waiting:
            admitted = try_admit()
            if admitted is not None:
                return admitted
        ticket = object()
        with self._lock:
            if len(self._tickets) >= self.limits.max_queued_requests:
                raise QueueFullError(
                    f"queue full: {len(self._tickets)} requests already wait for {self._what} "
                    f"(--max-queued-requests {self.limits.max_queued_requests})"
                )
            self._tickets.append(ticket)
            num_waiting = len(self._tickets)
        self._report(num_waiting)
        try:
            return self._wait_turn(ticket, try_admit, stop_reason, while_waiting)
        finally:
            with self._changed:
                self._tickets.remove(ticket)
                num_waiting = len(self._tickets)
                self._changed.notify_all()  # the next head tries at once
            self._report(num_waiting)

    def _wait_turn(
        self,
        ticket: object,
        try_admit: Callable[[], Admitted | None],
        stop_reason: Callable[[], Exception | None],
        while_waiting: Callable[[], None],
    ) -> Admitted:
        started = time.monotonic()
        while True:
            reason = stop_reason()
            if reason is not None:
                raise reason
            waited_s = time.monotonic() - started
            if waited_s >= self.limits.max_wait_s:
                raise QueueTimeoutError(
                    f"waited {waited_s:.1f} s in the queue for {self._what} "
                    f"(--max-queue-wait-s {self.limits.max_wait_s:g})"
                )
            with self._lock:
                is_head = self._tickets[0] is ticket
            if is_head:
                admitted = try_admit()
                if admitted is not None:
                    return admitted
            while_waiting()
            remaining_s = self.limits.max_wait_s - (time.monotonic() - started)
            with self._changed:
                has_become_head = not is_head and self._tickets[0] is ticket
                if not has_become_head:  # else its first try comes now, not a poll later
                    self._changed.wait(timeout=max(0.0, min(self._poll_interval_s, remaining_s)))

    def _report(self, num_waiting: int) -> None:
        if self._on_change is not None:
            self._on_change(num_waiting)

    def check_integrity(self) -> None:
        with self._lock:
            assert len(self._tickets) <= self.limits.max_queued_requests, "queue past its bound"
            assert len(set(map(id, self._tickets))) == len(self._tickets), "a ticket queued twice"
