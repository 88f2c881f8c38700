"""What the fault-matrix tests share: a deployment whose stages are held open by the test hooks
(beamsplit/server/fault_hooks.py), stage detection from the metrics, and the after-fault checks."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from beamsplit.client.grpc_client import BeamsplitClient, build_request
from beamsplit.launch.launcher import ProcessGroup, ServerProcess
from beamsplit.launch.local_cluster import DEFAULT_ENGINE_ARGUMENTS
from beamsplit.v1 import common_pb2

PROMPT = list(range(10, 77))  # 67 tokens: 3 pages of 32
SHORT = common_pb2.SamplingOptions(beam_width=2, max_new_tokens=4)
LONG = common_pb2.SamplingOptions(beam_width=4, max_new_tokens=2000, ignore_eos=True)

# Every request is held this long at each stage (engine thread before the prefill; generation
# worker before the pull; holder before its sends), so a test finds each stage open for a while.
PREFILL_DELAY_S = 1.2
PULL_DELAY_S = 0.8
SERVE_DELAY_S = 1.2
LEASE_S = 4.0  # asked by the coordinator; longer than a pull (PULL_DELAY_S + SERVE_DELAY_S)
PULL_TIMEOUT_S = 4.0
WATCHDOG_S = 2.0
CLEAN_BOUND_S = 10.0  # pools empty, no hold or pull left, after any fault (docs/faults.md)
HOOKS = {
    "BEAMSPLIT_TEST_PREFILL_DELAY_S": str(PREFILL_DELAY_S),
    "BEAMSPLIT_TEST_PULL_DELAY_S": str(PULL_DELAY_S),
    "BEAMSPLIT_TEST_SERVE_DELAY_S": str(SERVE_DELAY_S),
    "BEAMSPLIT_TEST_WEDGE_ON_SIGUSR1": "1",
}
WORKER_ARGUMENTS = [*DEFAULT_ENGINE_ARGUMENTS, "--transfer-watchdog-s", str(WATCHDOG_S)]


@dataclass
class Spec:
    role: str
    arguments: list[str]
    env: dict[str, str]


@dataclass
class HookedDeployment:
    group: ProcessGroup
    context: ServerProcess
    generations: list[ServerProcess]
    coordinator: ServerProcess
    specs: dict[str, Spec] = field(default_factory=dict)

    @property
    def workers(self) -> list[ServerProcess]:
        return [self.context, *self.generations]

    def start(self, name: str, spec: Spec, replacing: ServerProcess | None = None) -> ServerProcess:
        self.specs[name] = spec
        return self.group.start(name, spec.role, spec.arguments, env=spec.env, same_ports_as=replacing)

    def restart(self, server: ServerProcess) -> ServerProcess:
        """Starts a killed server again on its ports (the coordinator's worker list is static)."""
        self.group.kill(server)
        new = self.start(server.name, self.specs[server.name], replacing=server)
        self.group.wait_healthy(new, 120.0)
        if server is self.context:
            self.context = new
        elif server is self.coordinator:
            self.coordinator = new
        else:
            self.generations = [new if old is server else old for old in self.generations]
        return new


def start_hooked_deployment(group: ProcessGroup) -> HookedDeployment:
    context = Spec("context", [*WORKER_ARGUMENTS, "--lease-s", str(LEASE_S)], HOOKS)
    generation = Spec(
        "generation",
        [*WORKER_ARGUMENTS, "--pull-timeout-s", str(PULL_TIMEOUT_S), "--shutdown-grace-s", "1"],
        HOOKS,
    )
    deployment = HookedDeployment(group, None, [], None)  # type: ignore[arg-type]
    deployment.context = deployment.start("context", context)
    deployment.generations = [deployment.start(f"generation-{index}", generation) for index in range(2)]
    coordinator = Spec(
        "coordinator",
        [
            "--context", deployment.context.address,
            "--generation", ",".join(server.address for server in deployment.generations),
            "--lease-s", str(LEASE_S),
        ],
        {},
    )  # fmt: skip
    deployment.coordinator = deployment.start("coordinator", coordinator)
    for server in (*deployment.workers, deployment.coordinator):
        group.wait_healthy(server, 180.0)
    return deployment


def metric(server: ServerProcess, name: str) -> float:
    value = server.metric(name)
    assert value is not None, f"{server.name} does not export {name}"
    return value


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until `predicate()` held; fails the test past the bound."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def leftovers(deployment: HookedDeployment) -> dict[str, float]:
    """Blocks in use, holds and pulls on every live worker, requests in flight on the coordinator."""
    found = {}
    for server in deployment.workers:
        if server.is_alive():
            found[f"{server.name} blocks"] = metric(server, "beamsplit_kv_blocks_in_use")
            found[f"{server.name} transfers"] = metric(server, "beamsplit_transfers_in_flight")
    if deployment.coordinator.is_alive():
        found["coordinator requests"] = metric(deployment.coordinator, "beamsplit_requests_in_flight")
    return {name: value for name, value in found.items() if value != 0}


def outcome(error: BaseException | None, result: object = None) -> str:
    """What the client received, for the printed matrix."""
    if error is None:
        return f"ok (generation worker {getattr(result, 'stats', {}).get('generation_worker', '?')})"
    assert isinstance(error, grpc.RpcError), error
    return f"{error.code().name}: {error.details()}"


def wait_clean(deployment: HookedDeployment, fault: str, since: float, client_saw: str = "") -> float:
    """Waits (bounded) until nothing is held anywhere; prints and returns seconds since `since`."""
    deadline = since + CLEAN_BOUND_S
    while time.monotonic() < deadline:
        if not leftovers(deployment):
            elapsed = time.monotonic() - since
            print(f"\nFAULT-MATRIX {fault}: pools empty {elapsed:.2f} s after the fault", flush=True)
            if client_saw:
                print(f"FAULT-MATRIX {fault}: the client received {client_saw}", flush=True)
            return elapsed
        time.sleep(0.05)
    raise AssertionError(f"{fault}: still held {CLEAN_BOUND_S} s after the fault: {leftovers(deployment)}")


def assert_serves(deployment: HookedDeployment, probe_wait_s: float = 5.0) -> None:
    """A new request is served; a worker just restarted or resumed may wait for the coordinator's
    next health probe (every 0.5 s) to be routed to again, up to `probe_wait_s`."""
    deadline = time.monotonic() + probe_wait_s
    with BeamsplitClient(deployment.coordinator.address) as client:
        while True:
            try:
                result = client.generate(build_request(token_ids=PROMPT, sampling=SHORT), timeout_s=30.0)
                break
            except grpc.RpcError as error:
                if "no healthy" not in (error.details() or "") or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    assert len(result.beams) == 2


def stage_is(server: ServerProcess, blocks: bool, pulls: bool) -> Callable[[], bool]:
    """A generation worker holding a reservation (`blocks`) with (`pulls`) or without a pull running."""

    def check() -> bool:
        return (metric(server, "beamsplit_kv_blocks_in_use") > 0) == blocks and (
            metric(server, "beamsplit_transfers_in_flight") > 0
        ) == pulls

    return check


def busy_generation(deployment: HookedDeployment, pulls: bool, timeout_s: float = 10.0) -> ServerProcess:
    """The generation worker that reached the stage: reserved, and pulling or not yet."""
    found: list[ServerProcess] = []

    def reached() -> bool:
        found[:] = [server for server in deployment.generations if stage_is(server, True, pulls)()]
        return bool(found)

    wait_until(reached, timeout_s, f"a generation worker {'pulling' if pulls else 'reserved, not pulling'}")
    return found[0]


def signal_process(server: ServerProcess, number: signal.Signals) -> None:
    import os

    os.kill(server.pid, number)


def rpc_code(error: BaseException) -> grpc.StatusCode:
    assert isinstance(error, grpc.RpcError), error
    return error.code()
