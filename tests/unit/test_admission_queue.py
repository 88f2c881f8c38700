"""The workers' admission queue: admitted at once when it fits, else a bounded FIFO wait; a full
queue, a wait past its bound, a stop or a "never" refusal each end the wait with nothing held.

The "pool" is a counter of free slots the tests move by hand; threads wait on events, never on
the clock, except the one test of the wait bound itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from beamsplit.server.admission_queue import (
    AdmissionLimits,
    AdmissionQueue,
    QueueFullError,
    QueueTimeoutError,
)

BOUND_S = 10.0  # every join in these tests; nothing should come close


class Pool:
    """Free slots; `take` is a queue's `try_admit` for one slot."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.lock = threading.Lock()
        self.admitted: list[str] = []

    def take(self, name: str) -> Callable[[], str | None]:
        def try_admit() -> str | None:
            with self.lock:
                if self.free == 0:
                    return None
                self.free -= 1
                self.admitted.append(name)
                return name

        return try_admit

    def give_back(self) -> None:
        with self.lock:
            self.free += 1


def never_stop() -> Exception | None:
    return None


class Waiter(threading.Thread):
    def __init__(self, queue: AdmissionQueue, pool: Pool, name: str) -> None:
        super().__init__(daemon=True)
        self.queue, self.pool, self.request = queue, pool, name
        self.stop = threading.Event()
        self.result: str | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            self.result = self.queue.admit(
                self.pool.take(self.request),
                lambda: RuntimeError("stopped") if self.stop.is_set() else None,
            )
        except Exception as error:
            self.error = error


def wait_until(condition: Callable[[], bool]) -> None:
    event = threading.Event()
    for _ in range(int(BOUND_S / 0.01)):
        if condition():
            return
        event.wait(0.01)
    raise AssertionError("condition not reached")


def test_admitted_at_once_when_it_fits_and_nobody_waits() -> None:
    queue, pool = AdmissionQueue(AdmissionLimits(max_queued_requests=0)), Pool(free=1)
    assert queue.admit(pool.take("a"), never_stop) == "a"
    with pytest.raises(QueueFullError, match=r"queue full: 0 requests .*--max-queued-requests 0"):
        queue.admit(pool.take("b"), never_stop)  # 0: refuse whatever does not fit now
    assert pool.admitted == ["a"] and queue.num_waiting == 0
    queue.check_integrity()


def test_full_queue_refuses_at_once_and_waiters_go_first_come_first_served() -> None:
    counts: list[int] = []
    queue = AdmissionQueue(AdmissionLimits(max_queued_requests=2, max_wait_s=60.0), on_change=counts.append)
    pool = Pool(free=0)
    first, second = Waiter(queue, pool, "first"), Waiter(queue, pool, "second")
    first.start()
    wait_until(lambda: queue.num_waiting == 1)
    second.start()
    wait_until(lambda: queue.num_waiting == 2)
    with pytest.raises(
        QueueFullError, match=r"2 requests already wait for KV blocks \(--max-queued-requests 2\)"
    ):
        queue.admit(pool.take("third"), never_stop)
    queue.check_integrity()
    pool.give_back()
    first.join(BOUND_S)
    assert first.result == "first" and pool.admitted == ["first"]  # only the head may take it
    assert second.is_alive()
    pool.give_back()
    second.join(BOUND_S)
    assert second.result == "second" and pool.admitted == ["first", "second"]
    assert queue.num_waiting == 0 and counts[-1] == 0 and max(counts) == 2
    queue.check_integrity()


def test_a_newcomer_does_not_overtake_the_queue() -> None:
    queue, pool = AdmissionQueue(AdmissionLimits(max_queued_requests=2, max_wait_s=60.0)), Pool(free=0)
    waiter = Waiter(queue, pool, "waiter")
    waiter.start()
    wait_until(lambda: queue.num_waiting == 1)
    newcomer = Waiter(queue, pool, "newcomer")
    newcomer.start()
    wait_until(lambda: queue.num_waiting == 2)
    pool.give_back()
    waiter.join(BOUND_S)
    assert pool.admitted == ["waiter"]
    newcomer.stop.set()
    newcomer.join(BOUND_S)
    assert str(newcomer.error) == "stopped" and queue.num_waiting == 0


def test_a_stopped_waiter_leaves_and_the_next_one_becomes_head() -> None:
    queue, pool = AdmissionQueue(AdmissionLimits(max_queued_requests=2, max_wait_s=60.0)), Pool(free=0)
    head, next_one = Waiter(queue, pool, "head"), Waiter(queue, pool, "next")
    head.start()
    wait_until(lambda: queue.num_waiting == 1)
    next_one.start()
    wait_until(lambda: queue.num_waiting == 2)
    head.stop.set()  # a cancel or a deadline: the stop reason is raised as is
    head.join(BOUND_S)
    assert str(head.error) == "stopped" and queue.num_waiting == 1
    pool.give_back()
    next_one.join(BOUND_S)
    assert next_one.result == "next" and pool.free == 0 and pool.admitted == ["next"]
    queue.check_integrity()


def test_a_wait_past_its_bound_is_refused_naming_the_limit() -> None:
    queue, pool = AdmissionQueue(AdmissionLimits(max_queued_requests=1, max_wait_s=0.2)), Pool(free=0)
    with pytest.raises(
        QueueTimeoutError, match=r"waited \d+\.\d s in the queue for KV blocks \(--max-queue-wait-s 0\.2\)"
    ):
        queue.admit(pool.take("late"), never_stop)
    assert queue.num_waiting == 0 and not pool.admitted


def test_never_fitting_and_while_waiting_errors_end_the_wait() -> None:
    queue = AdmissionQueue(AdmissionLimits(max_queued_requests=1, max_wait_s=60.0))

    def never() -> str | None:
        raise ValueError("larger than the pool")

    with pytest.raises(ValueError, match="larger than the pool"):
        queue.admit(never, never_stop)

    def hold_dropped() -> None:
        raise LookupError("context worker dropped the prompt's pages")

    with pytest.raises(LookupError, match="dropped"):
        queue.admit(Pool(free=0).take("x"), never_stop, while_waiting=hold_dropped)
    assert queue.num_waiting == 0
    queue.check_integrity()


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_queued_requests"):
        AdmissionLimits(max_queued_requests=-1)
    with pytest.raises(ValueError, match="max_wait_s"):
        AdmissionLimits(max_wait_s=0)
