"""Turns on shared cores (beamsplit/server/core_lease.py): one holder at a time, turns that
alternate between processes that both want them, bounded waits, and a crash that frees the cores."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

from beamsplit.server.core_lease import CoreLease

TURNS = 25
TURN_S = 0.004
CONTEXT = multiprocessing.get_context("spawn")  # no torch or threads of this process forked


def take_turns(path: str, name: str, log: str, ready: multiprocessing.synchronize.Barrier) -> None:
    """TURNS turns of TURN_S each, every turn's start and end appended to `log` by one write."""
    lease = CoreLease(Path(path))
    descriptor = os.open(log, os.O_WRONLY | os.O_APPEND)
    ready.wait(30.0)
    for _ in range(TURNS):
        with lease.turn() as held:
            assert held
            os.write(descriptor, f"{name} start {time.monotonic():.6f}\n".encode())
            time.sleep(TURN_S)  # the cores are this process's: the other waits, asleep
            os.write(descriptor, f"{name} end {time.monotonic():.6f}\n".encode())


def hold_forever(path: str, holding: multiprocessing.synchronize.Event) -> None:
    lease = CoreLease(Path(path))
    with lease.turn():
        holding.set()
        time.sleep(600.0)


def stop(process: multiprocessing.process.BaseProcess) -> None:
    if process.is_alive():
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
    process.join(10.0)


def test_two_processes_never_hold_the_cores_at_once_and_their_turns_alternate(tmp_path: Path) -> None:
    log = tmp_path / "turns.log"
    log.touch()
    ready = CONTEXT.Barrier(2)
    processes = [
        CONTEXT.Process(target=take_turns, args=(str(tmp_path / "cores.lock"), name, str(log), ready))
        for name in ("A", "B")
    ]
    try:
        for process in processes:
            process.start()
        for process in processes:
            process.join(60.0)
            assert process.exitcode == 0
    finally:
        for process in processes:
            stop(process)
    events = [line.split() for line in log.read_text().splitlines()]
    assert len(events) == 4 * TURNS
    # Each start is followed by the same process's end: no turn began while another was held.
    for start, end in zip(events[::2], events[1::2], strict=True):
        assert start[1] == "start" and end[1] == "end" and start[0] == end[0], (start, end)
        assert float(start[2]) <= float(end[2])
    # While both want turns, neither takes two in a row (flock alone would hand the cores back to
    # the process that just released them); once one is done the other runs on alone.
    holders = [start[0] for start in events[::2]]
    last_a, last_b = (
        max(i for i, h in enumerate(holders) if h == "A"),
        max(i for i, h in enumerate(holders) if h == "B"),
    )
    both = holders[: min(last_a, last_b) + 1]
    first_switch = next(i for i in range(1, len(both)) if both[i] != both[i - 1])
    repeats = [i for i in range(first_switch, len(both)) if both[i] == both[i - 1]]
    assert len(repeats) <= 1, holders  # a scheduling hiccup at most, never a run


def test_a_turn_not_had_within_the_bound_is_skipped_and_the_body_runs(tmp_path: Path) -> None:
    holder = CoreLease(tmp_path / "cores.lock")  # another open file description: another holder
    waiter = CoreLease(tmp_path / "cores.lock", wait_bound_s=0.2)
    try:
        with holder.turn() as held:
            assert held
            started = time.monotonic()
            with waiter.turn() as waited:
                assert not waited
            assert 0.2 <= time.monotonic() - started < 2.0
            assert waiter.turns_skipped == 1
        started = time.monotonic()
        with waiter.turn() as waited:  # released: had at once, and released again after
            assert waited and time.monotonic() - started < 0.1
        with holder.turn() as held:
            assert held
    finally:
        holder.close()
        waiter.close()


def test_a_holder_that_dies_mid_turn_frees_the_cores(tmp_path: Path) -> None:
    path = tmp_path / "cores.lock"
    holding = CONTEXT.Event()
    process = CONTEXT.Process(target=hold_forever, args=(str(path), holding))
    lease = CoreLease(path, wait_bound_s=30.0)
    try:
        process.start()
        assert holding.wait(60.0)
        other = CoreLease(path, wait_bound_s=0.1)
        with other.turn() as held:
            assert not held  # held by the child
        other.close()
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        started = time.monotonic()
        with lease.turn() as held:
            assert held and time.monotonic() - started < 5.0  # at its death, not at the bound
    finally:
        stop(process)
        lease.close()
