"""A generation worker whose pool cannot take a request when the pull should start: the coordinator
tries another generation worker (nothing was streamed yet); when none has room the client gets
RESOURCE_EXHAUSTED naming each refusal (HTTP 429 through the OpenAI front).

A 1+2 deployment: the first generation worker (picked first when both are idle) has 8 blocks,
the second 64.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from beamsplit.client.grpc_client import BeamsplitClient, build_request
from beamsplit.launch.launcher import ProcessGroup, ServerProcess
from beamsplit.launch.local_cluster import DEFAULT_ENGINE_ARGUMENTS
from beamsplit.v1 import common_pb2
from tests.helpers.routing import wait_until_coordinator_sees_every_worker

PROMPT = list(range(10, 77))  # 67 tokens: 2 full blocks and a tail
FITS_SMALL = common_pb2.SamplingOptions(beam_width=2, max_new_tokens=4)  # 2 + 2 * 1 = 4 blocks
NEEDS_BIG = common_pb2.SamplingOptions(beam_width=4, max_new_tokens=100)  # 2 + 4 * 4 = 18 blocks
FITS_NOWHERE = common_pb2.SamplingOptions(beam_width=8, max_new_tokens=1000)  # 2 + 8 * 32 = 258


@dataclass
class PoolDeployment:
    context: ServerProcess
    small: ServerProcess
    big: ServerProcess
    coordinator: ServerProcess

    def blocks_in_use(self) -> dict[str, float | None]:
        return {s.name: s.metric("beamsplit_kv_blocks_in_use") for s in (self.context, self.small, self.big)}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolDeployment]:
    group = ProcessGroup(tmp_path_factory.mktemp("fault-pool-full"))
    try:
        context = group.start("context", "context", [*DEFAULT_ENGINE_ARGUMENTS])
        small = group.start(
            "generation-small", "generation", [*DEFAULT_ENGINE_ARGUMENTS, "--num-blocks", "8"]
        )
        big = group.start("generation-big", "generation", [*DEFAULT_ENGINE_ARGUMENTS, "--num-blocks", "64"])
        coordinator = group.start(
            "coordinator",
            "coordinator",
            ["--context", context.address, "--generation", f"{small.address},{big.address}"],
            http=True,
        )
        for server in (context, small, big, coordinator):
            group.wait_healthy(server, 180.0)
        wait_until_coordinator_sees_every_worker(coordinator.address, 3)
        yield PoolDeployment(context, small, big, coordinator)
    finally:
        codes = group.stop_all()
    assert set(codes.values()) == {0}, codes


def wait_empty(deployment: PoolDeployment, since: float, what: str) -> None:
    while time.monotonic() - since < 5.0:
        if all(value == 0 for value in deployment.blocks_in_use().values()):
            print(f"\nFAULT-MATRIX {what}: pools empty {time.monotonic() - since:.2f} s after", flush=True)
            return
        time.sleep(0.05)
    raise AssertionError(deployment.blocks_in_use())


def test_full_generation_worker_is_retried_elsewhere(deployment: PoolDeployment) -> None:
    with BeamsplitClient(deployment.coordinator.address) as client:
        # First, while both workers are idle: the small one is picked, refuses, and the retry
        # goes to the big one.
        big = client.generate(build_request(token_ids=PROMPT, sampling=NEEDS_BIG), timeout_s=60.0)
    ended = time.monotonic()
    assert big.stats["generation_worker"] == deployment.big.address
    assert len(big.beams) == 4
    refused = deployment.small.metrics_text()
    assert 'beamsplit_requests_total{outcome="resource_exhausted"} 1.0' in refused
    assert "needs up to 18 blocks, more than the pool's 8 in all" in deployment.small.log_path.read_text()
    wait_empty(deployment, ended, "generation pool full, retried on another worker")
    with BeamsplitClient(deployment.coordinator.address) as client:
        assert client.generate(build_request(token_ids=PROMPT, sampling=FITS_SMALL), timeout_s=60.0).beams


def test_no_generation_worker_with_room_is_resource_exhausted(deployment: PoolDeployment) -> None:
    with BeamsplitClient(deployment.coordinator.address) as client, pytest.raises(grpc.RpcError) as raised:
        client.generate(build_request(token_ids=PROMPT, sampling=FITS_NOWHERE), timeout_s=60.0)
    ended = time.monotonic()
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = raised.value.details()
    assert details.startswith("no generation worker has room for this request"), details
    for worker in (deployment.small, deployment.big):
        assert worker.address in details
    assert "needs up to 258 blocks, more than the pool's 8 in all" in details
    wait_empty(deployment, ended, "every generation pool full")

    body = json.dumps(
        {"model": "tiny", "prompt": PROMPT, "max_tokens": 1000, "n": 8, "use_beam_search": True}
    ).encode()
    request = urllib.request.Request(
        f"{deployment.coordinator.http_url}/completions", body, {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as http_error:
        urllib.request.urlopen(request, timeout=60.0)
    assert http_error.value.code == 429
    error = json.loads(http_error.value.read())["error"]
    assert error["message"].startswith("no generation worker has room"), error
    wait_empty(deployment, time.monotonic(), "every generation pool full (HTTP)")

    with BeamsplitClient(deployment.coordinator.address) as client:
        assert client.generate(build_request(token_ids=PROMPT, sampling=FITS_SMALL), timeout_s=60.0).beams
