"""Processes killed, frozen or wedged mid-request: a context worker and two generation workers
behind a coordinator, every stage held open by the test hooks (fault_matrix_helpers). After each
fault: nothing held on any live worker within the bound, the next request is served, and the
test restarts only what it broke (docs/faults.md lists what the client sees)."""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from beamsplit.client.grpc_client import BeamsplitClient, build_request
from beamsplit.launch.launcher import ProcessGroup, ServerProcess
from beamsplit.server.server_common import check_health, peer_channel
from beamsplit.v1 import worker_pb2, worker_pb2_grpc
from tests.integration.fault_matrix_helpers import (
    LEASE_S,
    LONG,
    PROMPT,
    PULL_TIMEOUT_S,
    SHORT,
    WATCHDOG_S,
    HookedDeployment,
    assert_serves,
    busy_generation,
    metric,
    outcome,
    signal_process,
    start_hooked_deployment,
    wait_clean,
    wait_until,
)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HookedDeployment]:
    group = ProcessGroup(tmp_path_factory.mktemp("fault-kills"))
    try:
        yield start_hooked_deployment(group)
    finally:
        for server in group.processes:  # a test that failed midway may leave one stopped
            if server.is_alive():
                signal_process(server, signal.SIGCONT)
        codes = group.stop_all()
    assert set(codes.values()) == {0}, codes


class Background:
    """One request run on a thread: its result, or the error the client received."""

    def __init__(self, address: str, sampling: Any = SHORT, timeout_s: float = 40.0) -> None:
        self.result: Any = None
        self.error: grpc.RpcError | None = None

        def run() -> None:
            with BeamsplitClient(address) as client:
                try:
                    self.result = client.generate(
                        build_request(token_ids=PROMPT, sampling=sampling), timeout_s
                    )
                except grpc.RpcError as error:
                    self.error = error

        self._thread = threading.Thread(target=run)
        self._thread.start()

    def join(self) -> Background:
        self._thread.join(timeout=60.0)
        assert not self._thread.is_alive()
        return self


def held_transfer_ids(server: ServerProcess) -> list[str]:
    return re.findall(r"pages held as (\S+) for", server.log_path.read_text())


def is_hold_alive(server: ServerProcess, transfer_id: str) -> bool:
    with grpc.insecure_channel(server.address) as channel:
        beat = worker_pb2_grpc.ContextWorkerStub(channel).Heartbeat(
            worker_pb2.HeartbeatRequest(transfer_id=transfer_id, extend_s=30.0), timeout=5.0
        )
    return bool(beat.alive)


def test_wedged_transfer_layer_reports_not_serving(deployment: HookedDeployment) -> None:
    wedged = deployment.generations[1]
    with peer_channel(wedged.address) as channel:
        assert check_health(channel, 2.0)
        signal_process(wedged, signal.SIGUSR1)  # the hook blocks its UCX agent's loop
        started = time.monotonic()
        took_s = wait_until(lambda: not check_health(channel, 1.0), WATCHDOG_S + 2.0, "NOT_SERVING")
    print(f"\nFAULT-MATRIX wedged transfer loop: NOT_SERVING after {took_s:.2f} s", flush=True)
    assert took_s >= WATCHDOG_S - 0.5  # the watchdog's bound, not a failed call, turned it
    time.sleep(1.0)  # the coordinator's probe (every 0.5 s) takes it out of routing
    with BeamsplitClient(deployment.coordinator.address) as client:
        for _ in range(2):
            result = client.generate(build_request(token_ids=PROMPT, sampling=SHORT), timeout_s=30.0)
            assert result.stats["generation_worker"] == deployment.generations[0].address
    wait_clean(deployment, "wedged transfer loop (two requests routed around it included)", started)
    deployment.restart(wedged)
    assert_serves(deployment)


@pytest.mark.parametrize("stage", ["pulling", "decoding"])
def test_generation_worker_killed(deployment: HookedDeployment, stage: str) -> None:
    if stage == "pulling":
        request = Background(deployment.coordinator.address)
        victim = busy_generation(deployment, pulls=True)
        deployment.group.kill(victim)
        started = time.monotonic()
        request.join()
        # Nothing was streamed: the coordinator retried on the other generation worker.
        assert request.error is None, request.error
        survivor = next(server for server in deployment.generations if server is not victim)
        assert request.result.stats["generation_worker"] == survivor.address
    else:
        with BeamsplitClient(deployment.coordinator.address) as client:
            responses = iter(client.stream(build_request(token_ids=PROMPT, sampling=LONG), timeout_s=60.0))
            assert next(responses).HasField("delta")
            victim = next(s for s in deployment.generations if metric(s, "beamsplit_kv_blocks_in_use") > 0)
            deployment.group.kill(victim)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as raised:
                for _ in responses:
                    pass
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"generation worker {victim.address} failed" in raised.value.details()
    retried = " (the retried request included)" if stage == "pulling" else ""
    saw = outcome(request.error, request.result) if stage == "pulling" else outcome(raised.value)
    wait_clean(deployment, f"generation worker killed while {stage}{retried}", started, saw)
    deployment.restart(victim)
    assert_serves(deployment)


@pytest.mark.parametrize("pulls", [False, True], ids=["before-the-pull", "during-the-pull"])
def test_context_worker_killed(deployment: HookedDeployment, pulls: bool) -> None:
    request = Background(deployment.coordinator.address)
    busy_generation(deployment, pulls=pulls)
    deployment.group.kill(deployment.context)
    started = time.monotonic()
    request.join()
    assert request.error is not None and request.error.code() == grpc.StatusCode.UNAVAILABLE
    assert "context worker" in request.error.details(), request.error.details()
    assert time.monotonic() - started < PULL_TIMEOUT_S  # the pull failed at once, not at its timeout
    when = "during" if pulls else "before"
    wait_clean(deployment, f"context worker killed {when} the pull", started, outcome(request.error))
    deployment.restart(deployment.context)
    assert_serves(deployment)


def _freeze(server: ServerProcess, seconds: float, during: Callable[[], None] | None = None) -> float:
    signal_process(server, signal.SIGSTOP)
    try:
        frozen_until = time.monotonic() + seconds
        if during is not None:
            during()
        time.sleep(max(0.0, frozen_until - time.monotonic()))
    finally:
        signal_process(server, signal.SIGCONT)
    return time.monotonic()


def test_frozen_context_worker_revokes_its_leases(deployment: HookedDeployment) -> None:
    before = set(held_transfer_ids(deployment.context))
    request = Background(deployment.coordinator.address)
    busy_generation(deployment, pulls=True)
    resumed = _freeze(deployment.context, LEASE_S + 2.0)
    request.join()
    # The pull timed out; the frozen worker failed its health probes, so the retry found none.
    assert request.error is not None and request.error.code() == grpc.StatusCode.UNAVAILABLE
    assert request.error.details() == "no healthy context worker", request.error.details()
    wait_clean(deployment, "context worker frozen past its lease", resumed, outcome(request.error))
    stale = [tid for tid in held_transfer_ids(deployment.context) if tid not in before]
    assert len(stale) == 1
    assert not any(is_hold_alive(deployment.context, tid) for tid in stale)
    assert "ERROR" not in deployment.context.log_path.read_text()  # no double release
    assert_serves(deployment)


def test_puller_frozen_mid_pull_past_its_lease(deployment: HookedDeployment) -> None:
    before = set(held_transfer_ids(deployment.context))
    request = Background(deployment.coordinator.address)
    puller = busy_generation(deployment, pulls=True)
    freed: list[float] = []

    def context_frees_the_hold() -> None:  # on its own timers: no request arrives meanwhile
        started = time.monotonic()
        wait_until(
            lambda: (
                metric(deployment.context, "beamsplit_kv_blocks_in_use") == 0
                and metric(deployment.context, "beamsplit_transfers_in_flight") == 0
            ),
            LEASE_S + 3.0,
            "the context worker ends the hold of a frozen puller",
        )
        freed.append(time.monotonic() - started)

    resumed = _freeze(puller, LEASE_S + 2.0, during=context_frees_the_hold)
    print(f"\nFAULT-MATRIX puller frozen mid-pull: holder freed its pages {freed[0]:.2f} s in", flush=True)
    request.join()
    assert request.error is None, request.error  # retried: nothing had been streamed
    saw = outcome(request.error, request.result)
    wait_clean(deployment, "puller frozen mid-pull past its lease", resumed, saw)
    stale = [tid for tid in held_transfer_ids(deployment.context) if tid not in before]
    assert stale and not is_hold_alive(deployment.context, stale[0])
    assert "ERROR" not in deployment.context.log_path.read_text()
    assert_serves(deployment)


def test_coordinator_killed_with_requests_in_flight(deployment: HookedDeployment) -> None:
    decoding = BeamsplitClient(deployment.coordinator.address)
    responses = iter(decoding.stream(build_request(token_ids=PROMPT, sampling=LONG), timeout_s=60.0))
    assert next(responses).HasField("delta")
    pulling = Background(deployment.coordinator.address)
    wait_until(
        lambda: sum(metric(s, "beamsplit_transfers_in_flight") for s in deployment.generations) > 0,
        10.0,
        "a second request pulling",
    )
    deployment.group.kill(deployment.coordinator)
    started = time.monotonic()
    pulling.join()
    assert pulling.error is not None and pulling.error.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as raised:
        for _ in responses:
            pass
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    decoding.close()
    saw = f"{outcome(pulling.error)} (pulling); {outcome(raised.value)} (decoding)"
    wait_clean(deployment, "coordinator killed with requests in flight", started, saw)
    deployment.restart(deployment.coordinator)
    assert_serves(deployment)
