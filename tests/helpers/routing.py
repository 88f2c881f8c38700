"""Waits a test needs before it relies on the coordinator's routing."""

from __future__ import annotations

import time

from beamsplit.cli.status import fetch_status


def wait_until_coordinator_sees_every_worker(address: str, num_workers: int, timeout_s: float = 30.0) -> None:
    """The coordinator serves once one worker of each role answered; a test that relies on routing
    between workers needs its probes to have found every worker healthy first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = fetch_status(address, 5.0).workers
        if len(workers) == num_workers and all(worker.healthy for worker in workers):
            return
        time.sleep(0.1)
    raise AssertionError(f"coordinator still sees {fetch_status(address, 5.0).workers}")
