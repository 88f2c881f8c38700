"""Faults never strand KV pages or hang a client: cancel, deadline, lease lapse, a killed or
stopped worker. Routing goes to the least loaded healthy worker and never to a dead one.

One deployment for the module: a context worker (short lease), two generation workers and a
coordinator. The tests run in file order; the last ones stop workers for good.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from beamsplit.client.grpc_client import BeamsplitClient, build_request
from beamsplit.launch.launcher import ProcessGroup, ServerProcess
from beamsplit.launch.local_cluster import DEFAULT_ENGINE_ARGUMENTS
from beamsplit.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.helpers.routing import wait_until_coordinator_sees_every_worker

LONG = common_pb2.SamplingOptions(beam_width=4, max_new_tokens=2000, ignore_eos=True)
SHORT = common_pb2.SamplingOptions(beam_width=2, max_new_tokens=4)
PROMPT = list(range(10, 77))  # 67 tokens: 3 pages


@dataclass
class Deployment:
    group: ProcessGroup
    context: ServerProcess
    generations: list[ServerProcess]
    coordinator: ServerProcess
    short_lease_coordinator: ServerProcess


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    group = ProcessGroup(tmp_path_factory.mktemp("service-faults"))
    try:
        context = group.start("context", "context", [*DEFAULT_ENGINE_ARGUMENTS, "--lease-s", "5"])
        generations = [
            group.start(
                f"generation-{index}", "generation", [*DEFAULT_ENGINE_ARGUMENTS, "--shutdown-grace-s", "1"]
            )
            for index in range(2)
        ]
        coordinator = group.start(
            "coordinator",
            "coordinator",
            [
                "--context",
                context.address,
                "--generation",
                ",".join(server.address for server in generations),
            ],
        )
        # Same workers, but it asks for leases that lapse before any pull can arrive.
        short_lease = group.start(
            "coordinator-short-lease",
            "coordinator",
            ["--context", context.address, "--generation", generations[0].address, "--lease-s", "0.001"],
        )
        for server in (context, *generations, coordinator, short_lease):
            group.wait_healthy(server, 180.0)
        # Routing by load needs both generation workers probed healthy, not just the first.
        wait_until_coordinator_sees_every_worker(coordinator.address, 3)
        yield Deployment(group, context, generations, coordinator, short_lease)
    finally:
        codes = group.stop_all()
    # The workers were stopped or killed by the tests; the coordinators must exit cleanly.
    assert codes["coordinator"] == 0 and codes["coordinator-short-lease"] == 0, codes


def blocks(server: ServerProcess) -> float:
    value = server.metric("beamsplit_kv_blocks_in_use")
    assert value is not None
    return value


def wait_for_zero_blocks(servers: list[ServerProcess], timeout_s: float = 8.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(blocks(server) == 0 for server in servers if server.is_alive()):
            return
        time.sleep(0.1)
    assert {server.name: blocks(server) for server in servers if server.is_alive()} == {}


def live(deployment: Deployment) -> list[ServerProcess]:
    return [server for server in (deployment.context, *deployment.generations) if server.is_alive()]


def start_long_request(client: BeamsplitClient, timeout_s: float = 120.0) -> tuple[object, Iterator]:  # type: ignore[type-arg]
    call = client.stream(build_request(token_ids=PROMPT, sampling=LONG), timeout_s=timeout_s)
    responses = iter(call)
    for _ in range(3):
        assert next(responses).HasField("delta")
    return call, responses


def test_concurrent_requests_go_to_the_least_loaded_worker(deployment: Deployment) -> None:
    with BeamsplitClient(deployment.coordinator.address) as client:
        call, _ = start_long_request(client)
        try:
            busy = [server for server in deployment.generations if blocks(server) > 0]
            assert len(busy) == 1
            # Another prompt: one sharing PROMPT's blocks would follow them to the busy worker
            # (prefix affinity within the load slack, docs/service.md Routing).
            other_prompt = [token + 100 for token in PROMPT]
            result = client.generate(build_request(token_ids=other_prompt, sampling=SHORT), timeout_s=60.0)
            assert result.stats["generation_worker"] != busy[0].address
        finally:
            call.cancel()  # type: ignore[attr-defined]
    wait_for_zero_blocks(live(deployment))


def test_client_cancel_frees_pages_on_both_workers(deployment: Deployment) -> None:
    with BeamsplitClient(deployment.coordinator.address) as client:
        call, _ = start_long_request(client)
        assert sum(blocks(server) for server in deployment.generations) > 0
        call.cancel()  # type: ignore[attr-defined]
    wait_for_zero_blocks(live(deployment), timeout_s=5.0)


def test_client_deadline_frees_pages(deployment: Deployment) -> None:
    with BeamsplitClient(deployment.coordinator.address) as client, pytest.raises(grpc.RpcError) as raised:
        client.generate(build_request(token_ids=PROMPT, sampling=LONG), timeout_s=1.5)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for_zero_blocks(live(deployment), timeout_s=5.0)


def test_held_prompt_is_released_by_release_heartbeat_or_lease(deployment: Deployment) -> None:
    with grpc.insecure_channel(deployment.context.address) as channel:
        stub = worker_pb2_grpc.ContextWorkerStub(channel)

        def prefill(attempt: int) -> worker_pb2.Handoff:
            request = worker_pb2.PrefillRequest(
                request_id="orphan", attempt=attempt, prompt_token_ids=PROMPT, num_candidates=4, lease_s=1.0
            )
            return stub.Prefill(request, timeout=30.0).handoff

        handoff = prefill(0)
        assert blocks(deployment.context) == 3
        assert stub.Release(worker_pb2.ReleaseRequest(transfer_id=handoff.transfer_id), timeout=5.0).released
        assert not stub.Release(
            worker_pb2.ReleaseRequest(transfer_id=handoff.transfer_id), timeout=5.0
        ).released
        wait_for_zero_blocks([deployment.context], timeout_s=2.0)

        handoff = prefill(1)
        for _ in range(5):  # 2.5 s of heartbeats keep a 1 s lease alive
            beat = stub.Heartbeat(
                worker_pb2.HeartbeatRequest(transfer_id=handoff.transfer_id, extend_s=1.0), timeout=5.0
            )
            assert beat.alive
            time.sleep(0.5)
        assert blocks(deployment.context) == 3
        wait_for_zero_blocks([deployment.context], timeout_s=6.0)  # no more heartbeats: the lease lapses
        beat = stub.Heartbeat(worker_pb2.HeartbeatRequest(transfer_id=handoff.transfer_id), timeout=5.0)
        assert not beat.alive


def test_lapsed_lease_fails_the_handoff_not_the_worker(deployment: Deployment) -> None:
    with (
        BeamsplitClient(deployment.short_lease_coordinator.address) as client,
        pytest.raises(grpc.RpcError) as raised,
    ):
        client.generate(build_request(token_ids=PROMPT, sampling=SHORT), timeout_s=30.0)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "pull of" in raised.value.details() and "TIMED_OUT" in raised.value.details(), (
        raised.value.details()
    )
    wait_for_zero_blocks(live(deployment))
    # The handoff failed, not the worker: it still serves through the normal coordinator.
    with BeamsplitClient(deployment.coordinator.address) as client:
        for _ in range(2):
            result = client.generate(build_request(token_ids=PROMPT, sampling=SHORT), timeout_s=30.0)
            assert result.beams
    with (
        BeamsplitClient(deployment.short_lease_coordinator.address) as client,
        pytest.raises(grpc.RpcError) as raised,
    ):
        client.generate(build_request(token_ids=PROMPT, sampling=SHORT), timeout_s=30.0)
    assert "no healthy" not in raised.value.details()
    wait_for_zero_blocks(live(deployment))


def test_killed_generation_worker_fails_the_request_clearly(deployment: Deployment) -> None:
    with BeamsplitClient(deployment.coordinator.address) as client:
        call, responses = start_long_request(client, timeout_s=60.0)
        serving = [server for server in deployment.generations if blocks(server) > 0]
        assert len(serving) == 1
        started = time.monotonic()
        deployment.group.kill(serving[0])
        with pytest.raises(grpc.RpcError) as raised:
            for _ in responses:
                pass
        assert time.monotonic() - started < 15.0
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "generation worker" in raised.value.details() and serving[0].address in raised.value.details()
        wait_for_zero_blocks(live(deployment))
        survivor = next(server for server in deployment.generations if server.is_alive())
        for _ in range(3):
            result = client.generate(build_request(token_ids=PROMPT, sampling=SHORT), timeout_s=60.0)
            assert result.stats["generation_worker"] == survivor.address
    wait_for_zero_blocks(live(deployment))


def test_sigterm_fails_in_flight_request_and_exits_cleanly(deployment: Deployment) -> None:
    survivor = next(server for server in deployment.generations if server.is_alive())
    errors: list[grpc.RpcError] = []
    with BeamsplitClient(deployment.coordinator.address) as client:
        call, responses = start_long_request(client, timeout_s=60.0)

        def drain() -> None:
            try:
                for _ in responses:
                    pass
            except grpc.RpcError as error:
                errors.append(error)

        reader = threading.Thread(target=drain)
        reader.start()
        assert deployment.group.stop(survivor, timeout_s=20.0) == 0
        reader.join(timeout=20.0)
        assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in errors[0].details()
        wait_for_zero_blocks([deployment.context])
        assert deployment.context.is_alive()
        with pytest.raises(grpc.RpcError) as raised:
            client.generate(build_request(token_ids=PROMPT, sampling=SHORT), timeout_s=20.0)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "generation worker" in raised.value.details()
    wait_for_zero_blocks([deployment.context])


def test_stopped_context_worker_releases_its_holds_and_is_routed_around(deployment: Deployment) -> None:
    with grpc.insecure_channel(deployment.context.address) as channel:
        request = worker_pb2.PrefillRequest(
            request_id="held", prompt_token_ids=PROMPT, num_candidates=4, lease_s=60
        )
        worker_pb2_grpc.ContextWorkerStub(channel).Prefill(request, timeout=30.0)
    assert blocks(deployment.context) == 3
    assert deployment.group.stop(deployment.context, timeout_s=20.0) == 0
    assert "blocks in use at exit: 0" in deployment.context.log_path.read_text()
    with BeamsplitClient(deployment.coordinator.address) as client:
        for settle_s in (0.0, 1.5):  # before and after a health probe has noticed
            time.sleep(settle_s)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as raised:
                client.generate(build_request(token_ids=PROMPT, sampling=SHORT), timeout_s=20.0)
            assert time.monotonic() - started < 10.0
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "worker" in raised.value.details()
        assert raised.value.details() == "no healthy context worker"
