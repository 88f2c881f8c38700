"""Turns on shared cores: the engine processes of one host compute one at a time, a step each.

A context and a generation worker on one host (the one-host launcher's deployment, `--shares-cores`)
each want every core for their torch threads. Computing side by side, their 2 x N threads take
turns at the scheduler's pace: a thread that reaches an OpenMP barrier waits for a sibling the
scheduler gave to the other process, so each region ends a time slice late, and a spinning waiter
burns the slice its sibling needs (docs/service.md, "The engine thread"). Sleeping at barriers
instead costs a wake-up per region: on a 2-core VM a greedy decode step took 65 ms against 42.

So they take turns: an engine step runs inside `CoreLease.turn()`, an exclusive lock on a file
both processes open. The holder has the cores to itself and its threads may spin briefly at
barriers; the other waits, asleep, until the step ends. A second file, the gate, makes the turns
alternate: a process waiting for the cores holds the gate, so the process that just released them
queues behind it instead of taking them straight back (flock hands a released lock to no one).

    A: gate+ cores+ gate-  [step]  cores-  gate?.....................gate+ cores?...cores+ gate- [step]
    B:              gate+ cores?...........cores+ gate-  [step]  cores-

Waits are bounded: a turn not had within `wait_bound_s` (the other process stopped mid-step,
say) is skipped and the step runs anyway, with a warning; a process that dies mid-step releases
both files with its descriptors, so a crash never strands the other.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

TURN_WAIT_BOUND_S = 10.0  # far above a step of the models a CPU host serves; below every RPC bound
_FIRST_POLL_S = 0.0001  # polls double from here up to _LAST_POLL_S: a handover is seen within 1 ms
_LAST_POLL_S = 0.001
_WARN_EVERY_S = 60.0


def default_lease_path() -> Path:
    """The lock file of this host's shared cores when none is given: one per user."""
    return Path(tempfile.gettempdir()) / f"beamsplit-cores-{os.getuid()}.lock"


class CoreLease:
    """The turn of one process on the cores it shares with the others opening the same `path`."""

    def __init__(self, path: Path, wait_bound_s: float = TURN_WAIT_BOUND_S) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._cores = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._gate = os.open(f"{path}.gate", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._wait_bound_s = wait_bound_s
        self._warned_at = -_WARN_EVERY_S
        self.turns_skipped = 0  # turns not had within the bound (the step ran without one)

    @contextmanager
    def turn(self, wait_bound_s: float | None = None) -> Iterator[bool]:
        """Holds the cores for the body, once the other processes' turns in progress end; yields
        whether the turn was had (False: the bound passed, the body runs without one). wait_bound_s:
        this turn's bound, else the lease's."""
        deadline = time.monotonic() + (self._wait_bound_s if wait_bound_s is None else wait_bound_s)
        held = False
        if self._take(self._gate, deadline):
            held = self._take(self._cores, deadline)
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        if not held:
            self._skipped()
        try:
            yield held
        finally:
            if held:
                fcntl.flock(self._cores, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._cores)
        os.close(self._gate)

    @staticmethod
    def _take(descriptor: int, deadline: float) -> bool:
        """An exclusive flock on `descriptor` by `deadline` (polled: flock has no timeout)."""
        pause = _FIRST_POLL_S
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(pause)
                pause = min(2 * pause, _LAST_POLL_S)

    def _skipped(self) -> None:
        self.turns_skipped += 1
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            logger.warning(
                "no turn on the shared cores within %.1f s (%s held by a stopped or slow process?): "
                "stepping without one (%d so far)",
                self._wait_bound_s, self.path, self.turns_skipped,
            )  # fmt: skip
