"""The test hooks read from the environment, and the transfer watchdog's turns (fake agent, fake
server: no gRPC, no UCX)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from beamsplit.server.fault_hooks import FaultHooks
from beamsplit.server.worker_setup import TransferWatchdog


def test_hooks_are_off_unless_set() -> None:
    assert FaultHooks.from_environment({}) == FaultHooks()
    hooks = FaultHooks.from_environment(
        {
            "BEAMSPLIT_TEST_PREFILL_DELAY_S": "1.5",
            "BEAMSPLIT_TEST_PULL_DELAY_S": "0.5",
            "BEAMSPLIT_TEST_SERVE_DELAY_S": "2",
            "BEAMSPLIT_TEST_STEP_DELAY_S": "0.01",
            "BEAMSPLIT_TEST_WEDGE_ON_SIGUSR1": "1",
        }
    )
    assert hooks == FaultHooks(1.5, 0.5, 2.0, 0.01, True)
    with pytest.raises(ValueError, match="serve_delay_s"):
        FaultHooks.from_environment({"BEAMSPLIT_TEST_SERVE_DELAY_S": "-1"})


class FakeAgent:
    def __init__(self) -> None:
        self.last_turn = time.monotonic()

    def loop_age_s(self) -> float:
        return time.monotonic() - self.last_turn


class FakeServer:
    def __init__(self) -> None:
        self.calls: list[tuple[list[str], bool]] = []

    def set_serving(self, service_names: list[str], is_serving: bool = True) -> None:
        self.calls.append((service_names, is_serving))


def test_watchdog_turns_not_serving_while_the_loop_is_stuck_and_back() -> None:
    agent, server = FakeAgent(), FakeServer()
    watchdog = TransferWatchdog(server, agent, ["svc"], bound_s=0.5)  # type: ignore[arg-type]
    watchdog.start()
    try:
        deadline = time.monotonic() + 0.4
        while time.monotonic() < deadline:  # a loop that turns: nothing to report
            agent.last_turn = time.monotonic()
            time.sleep(0.02)
        assert server.calls == []
        stuck_at = time.monotonic()
        _wait(lambda: server.calls == [(["svc"], False)], 2.0)
        assert time.monotonic() - stuck_at < 0.5 + 2 * TransferWatchdog.PERIOD_S + 0.2
        agent.last_turn = time.monotonic() + 5.0  # turning again
        _wait(lambda: server.calls[-1:] == [(["svc"], True)], 2.0)
    finally:
        watchdog.stop()


def _wait(predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.02)
