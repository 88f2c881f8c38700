"""Admission under load and prefix-aware routing, on real processes (docs/service.md, Admission
and Routing).

One deployment: a context worker, two generation workers of 40 blocks each and three
coordinators. `queue` (max 1 queued, a long wait) and `timeout` (a 1.5 s wait) each reach one
worker; `routing` reaches both. A FILL request (67-token prompt, W = 2, 600 new tokens: bound
2 + 2 * 19 = 40 blocks) takes a worker's whole pool until it is cancelled, so a SMALL one (3
blocks) has to wait. Every test ends with every pool at 0 blocks and every queue empty.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from beamsplit.cli.status import fetch_status
from beamsplit.client.grpc_client import BeamsplitClient, GenerateResult, build_request
from beamsplit.launch.launcher import ProcessGroup, ServerProcess
from beamsplit.launch.local_cluster import DEFAULT_ENGINE_ARGUMENTS
from beamsplit.server.metrics import read_samples
from beamsplit.v1 import common_pb2

FILL = common_pb2.SamplingOptions(beam_width=2, max_new_tokens=600, ignore_eos=True)
SMALL = common_pb2.SamplingOptions(beam_width=1, max_new_tokens=4)
HOLD = common_pb2.SamplingOptions(beam_width=1, max_new_tokens=900, ignore_eos=True)  # 33 blocks at most
SHORT_BEAMS = common_pb2.SamplingOptions(beam_width=2, max_new_tokens=4)
PREFIX = [(5 + 3 * index) % 250 for index in range(128)]  # 4 full blocks of 32
BOUND_S = 30.0  # every wait for a state in these tests
STEP_DELAY_S = 0.01  # generation workers' test hook: a FILL or a HOLD lasts 6 to 9 s at least


def prompt(offset: int, length: int = 67) -> list[int]:
    return [(offset + 11 * index) % 250 for index in range(length)]


def with_prefix(offset: int) -> list[int]:
    return PREFIX + prompt(offset, 8)  # 136 tokens: a lookup of prompt[:-1] matches 128


@dataclass
class Deployment:
    context: ServerProcess
    gen_a: ServerProcess  # queue: at most 1 waits, up to 120 s
    gen_b: ServerProcess  # timeout: a wait ends after 1.5 s
    queue: ServerProcess  # coordinator over gen_a, with the HTTP front
    timeout: ServerProcess  # coordinator over gen_b
    routing: ServerProcess  # coordinator over gen_a and gen_b

    @property
    def workers(self) -> list[ServerProcess]:
        return [self.context, self.gen_a, self.gen_b]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    group = ProcessGroup(tmp_path_factory.mktemp("admission-routing"))
    try:
        context = group.start("context", "context", [*DEFAULT_ENGINE_ARGUMENTS])
        pool = [*DEFAULT_ENGINE_ARGUMENTS, "--num-blocks", "40"]
        # A FILL decodes 600 steps: at 10 ms each it holds the pool for 6 s at least, however fast
        # the host (1.1 s undelayed here, which let a request meant to expire in the queue run).
        slow = {"BEAMSPLIT_TEST_STEP_DELAY_S": str(STEP_DELAY_S)}
        gen_a = group.start(
            "generation-a",
            "generation",
            [*pool, "--max-queued-requests", "1", "--max-queue-wait-s", "120"],
            env=slow,
        )
        gen_b = group.start(
            "generation-b",
            "generation",
            [*pool, "--max-queued-requests", "4", "--max-queue-wait-s", "1.5"],
            env=slow,
        )
        queue = group.start(
            "coordinator-queue",
            "coordinator",
            ["--context", context.address, "--generation", gen_a.address],
            http=True,
        )
        timeout = group.start(
            "coordinator-timeout",
            "coordinator",
            ["--context", context.address, "--generation", gen_b.address],
        )
        routing = group.start(
            "coordinator-routing",
            "coordinator",
            ["--context", context.address, "--generation", f"{gen_a.address},{gen_b.address}"],
        )
        for server in (context, gen_a, gen_b, queue, timeout, routing):
            group.wait_healthy(server, 180.0)
        yield Deployment(context, gen_a, gen_b, queue, timeout, routing)
    finally:
        codes = group.stop_all()
    assert set(codes.values()) == {0}, codes


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"not reached within {BOUND_S:.0f} s: {what}")


def queued(server: ServerProcess) -> float | None:
    return server.metric("beamsplit_admission_queued_requests")


def wait_idle(deployment: Deployment, coordinators: list[ServerProcess]) -> None:
    """Every pool back to 0 blocks, every queue empty, and each coordinator's probes seeing idle
    workers (routing reads their reported load)."""
    wait_for(
        lambda: (
            all(server.metric("beamsplit_kv_blocks_in_use") == 0 for server in deployment.workers)
            and queued(deployment.gen_a) == 0
            and queued(deployment.gen_b) == 0
        ),
        "pools at 0 and queues empty",
    )
    for coordinator in coordinators:
        wait_for(
            lambda coordinator=coordinator: all(  # type: ignore[misc]
                worker.healthy and worker.load.num_requests == 0
                for worker in fetch_status(coordinator.address, 5.0).workers
            ),
            f"{coordinator.name} sees idle workers",
        )


class Held:
    """A streaming request that has produced its first delta (it holds its blocks) until cancelled."""

    def __init__(self, client: BeamsplitClient, token_ids: list[int], sampling: common_pb2.SamplingOptions):
        self.call: Any = client.stream(build_request(token_ids=token_ids, sampling=sampling), timeout_s=120.0)
        first = next(iter(self.call))
        assert first.HasField("delta"), first

    def cancel(self) -> None:
        self.call.cancel()


class Background(threading.Thread):
    """One `generate` on a thread: its result or its error, joined with a bound."""

    def __init__(
        self, target: str, token_ids: list[int], sampling: common_pb2.SamplingOptions, timeout_s: float
    ):
        super().__init__(daemon=True)
        self._args = (target, token_ids, sampling, timeout_s)
        self.result: GenerateResult | None = None
        self.error: grpc.RpcError | None = None

    def run(self) -> None:
        target, token_ids, sampling, timeout_s = self._args
        try:
            with BeamsplitClient(target) as client:
                self.result = client.generate(
                    build_request(token_ids=token_ids, sampling=sampling), timeout_s
                )
        except grpc.RpcError as error:
            self.error = error

    def finish(self) -> Background:
        self.join(BOUND_S * 4)
        assert not self.is_alive(), "a request still runs past its bound"
        return self


def status_of(coordinator: ServerProcess, worker: ServerProcess) -> Any:
    statuses = fetch_status(coordinator.address, 5.0).workers
    return next(status for status in statuses if status.address == worker.address)


def outcome_count(server: ServerProcess, outcome: str) -> float:
    return read_samples(server.metrics_text(), "beamsplit_requests_total")[f'outcome="{outcome}"']


def test_a_full_queue_refuses_at_once_and_the_queued_request_runs_when_blocks_free(
    deployment: Deployment,
) -> None:
    refused_before = outcome_count(deployment.gen_a, "resource_exhausted")
    with BeamsplitClient(deployment.queue.address) as client:
        fill = Held(client, prompt(1), FILL)
        waiter = Background(deployment.queue.address, prompt(2), SMALL, timeout_s=120.0)
        try:
            waiter.start()
            wait_for(lambda: queued(deployment.gen_a) == 1, "the small request queued on generation-a")
            wait_for(
                lambda: status_of(deployment.queue, deployment.gen_a).load.num_waiting_requests == 1,
                "GetStatus shows the queue",
            )
            with pytest.raises(grpc.RpcError) as raised:
                client.generate(build_request(token_ids=prompt(3), sampling=SMALL), timeout_s=60.0)
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details = raised.value.details()
            assert details.startswith("no generation worker has room for this request"), details
            assert (
                "queue full: 1 requests already wait for KV blocks on this generation worker "
                "(--max-queued-requests 1)" in details
            ), details
            body = json.dumps({"model": "tiny", "prompt": prompt(4), "max_tokens": 4}).encode()
            request = urllib.request.Request(
                f"{deployment.queue.http_url}/completions", body, {"Content-Type": "application/json"}
            )
            with pytest.raises(urllib.error.HTTPError) as http_error:
                urllib.request.urlopen(request, timeout=60.0)
            assert http_error.value.code == 429
            assert "--max-queued-requests 1" in json.loads(http_error.value.read())["error"]["message"]
            assert waiter.is_alive() and queued(deployment.gen_a) == 1  # still waiting its turn
        finally:
            fill.cancel()
    waiter.finish()
    assert waiter.error is None, waiter.error
    assert waiter.result is not None and len(waiter.result.beams) == 1
    assert waiter.result.stats["generation_worker"] == deployment.gen_a.address
    assert outcome_count(deployment.gen_a, "resource_exhausted") == refused_before + 2
    wait_idle(deployment, [deployment.queue])


def test_a_queued_request_whose_client_leaves_frees_its_place(deployment: Deployment) -> None:
    with BeamsplitClient(deployment.queue.address) as client:
        fill = Held(client, prompt(5), FILL)
        try:
            with pytest.raises(grpc.RpcError) as raised:
                client.generate(build_request(token_ids=prompt(6), sampling=SMALL), timeout_s=2.0)
            assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            wait_for(lambda: queued(deployment.gen_a) == 0, "the expired request left the queue")
            # Its prompt's hold on the context worker ended too (fill's ended with its pull).
            wait_for(lambda: deployment.context.metric("beamsplit_transfers_in_flight") == 0, "holds ended")
        finally:
            fill.cancel()
    wait_idle(deployment, [deployment.queue])


def test_a_wait_past_the_bound_is_resource_exhausted_naming_the_limit(deployment: Deployment) -> None:
    with BeamsplitClient(deployment.timeout.address) as client:
        fill = Held(client, prompt(7), FILL)
        try:
            with pytest.raises(grpc.RpcError) as raised:
                client.generate(build_request(token_ids=prompt(8), sampling=SMALL), timeout_s=60.0)
        finally:
            fill.cancel()
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = raised.value.details()
    assert deployment.gen_b.address in details, details
    assert "s in the queue for KV blocks on this generation worker (--max-queue-wait-s 1.5)" in details
    wait_idle(deployment, [deployment.timeout])


def generation_reused(server: ServerProcess) -> float:
    return read_samples(server.metrics_text(), "beamsplit_prefix_reused_tokens_total")['side="generation"']


def test_requests_sharing_a_prefix_follow_it_and_unrelated_ones_spread_by_load(
    deployment: Deployment,
) -> None:
    route = deployment.routing.address
    wait_idle(deployment, [deployment.routing])
    with BeamsplitClient(route) as client:
        # 1. With generation-a busy, the first prompt with PREFIX goes to generation-b by load.
        busy_a = Held(client, prompt(9), HOLD)
        try:
            first = client.generate(build_request(token_ids=with_prefix(20), sampling=SHORT_BEAMS), 60.0)
        finally:
            busy_a.cancel()
        assert first.stats["generation_worker"] == deployment.gen_b.address
        wait_idle(deployment, [deployment.routing])

        # 2. Both idle: load alone would pick generation-a (first in the list); the prefix wins.
        reused_a, reused_b = generation_reused(deployment.gen_a), generation_reused(deployment.gen_b)
        for offset in (21, 22):
            result = client.generate(build_request(token_ids=with_prefix(offset), sampling=SHORT_BEAMS), 60.0)
            assert result.stats["generation_worker"] == deployment.gen_b.address
            assert result.stats["generation_reused_tokens"] == len(PREFIX)
            assert result.stats["transferred_blocks"] == 1  # only the block after the prefix
        assert generation_reused(deployment.gen_b) == reused_b + 2 * len(PREFIX)
        assert generation_reused(deployment.gen_a) == reused_a

        # 3. generation-b busy with a PREFIX request: an unrelated prompt goes to the least loaded
        #    worker, another PREFIX prompt still to generation-b (1 request above: within slack 2).
        busy_b = Held(client, with_prefix(23), HOLD)
        try:
            unrelated = client.generate(build_request(token_ids=prompt(10), sampling=SHORT_BEAMS), 60.0)
            sharing = client.generate(build_request(token_ids=with_prefix(24), sampling=SHORT_BEAMS), 60.0)
        finally:
            busy_b.cancel()
        assert unrelated.stats["generation_worker"] == deployment.gen_a.address
        assert sharing.stats["generation_worker"] == deployment.gen_b.address
        assert sharing.stats["generation_reused_tokens"] == len(PREFIX)
    wait_idle(deployment, [deployment.routing])
