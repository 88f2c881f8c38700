"""Test-only hooks that hold a request at one stage, so fault tests hit that stage without racing.

Read once from the environment at server start; all default to off, and nothing in a deployment
sets them. Each is a plain number handed to the part it slows (docs/faults.md):

- `BEAMSPLIT_TEST_PREFILL_DELAY_S` (context worker): the engine thread sleeps this long before
  each prefill, so a prefill takes at least this long and the next one queues behind it.
- `BEAMSPLIT_TEST_PULL_DELAY_S` (generation worker): after the reservation and before the pull
  starts, the request waits this long (cancel, shutdown and heartbeats still apply).
- `BEAMSPLIT_TEST_SERVE_DELAY_S` (context worker's transfer agent): after it accepted a PULL the
  holder waits this long before posting its sends: the pull is in flight, no byte has moved.
- `BEAMSPLIT_TEST_STEP_DELAY_S` (any engine server): the engine loop sleeps this long after each
  step that ran, so a long request holds its blocks for a known least time however fast the host
  is (admission tests fill a pool with one).
- `BEAMSPLIT_TEST_WEDGE_ON_SIGUSR1=1` (both workers): SIGUSR1 blocks the transfer agent's event
  loop for an hour, as a UCX call that never returns would (the health watchdog's test).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class FaultHooks:
    prefill_delay_s: float = 0.0
    pull_delay_s: float = 0.0
    serve_delay_s: float = 0.0
    step_delay_s: float = 0.0
    is_wedge_on_sigusr1: bool = False

    def __post_init__(self) -> None:
        for name in ("prefill_delay_s", "pull_delay_s", "serve_delay_s", "step_delay_s"):
            if not 0.0 <= getattr(self, name) <= 60.0:
                raise ValueError(f"{name} must be in [0, 60], got {getattr(self, name)}")

    @classmethod
    def from_environment(cls, environment: Mapping[str, str] | None = None) -> FaultHooks:
        source = os.environ if environment is None else environment
        return cls(
            prefill_delay_s=float(source.get("BEAMSPLIT_TEST_PREFILL_DELAY_S", "0") or 0),
            pull_delay_s=float(source.get("BEAMSPLIT_TEST_PULL_DELAY_S", "0") or 0),
            serve_delay_s=float(source.get("BEAMSPLIT_TEST_SERVE_DELAY_S", "0") or 0),
            step_delay_s=float(source.get("BEAMSPLIT_TEST_STEP_DELAY_S", "0") or 0),
            is_wedge_on_sigusr1=source.get("BEAMSPLIT_TEST_WEDGE_ON_SIGUSR1", "") == "1",
        )
