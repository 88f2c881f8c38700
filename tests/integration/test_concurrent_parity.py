"""Exact under load: 16 concurrent requests through both deployments equal their runs alone.

One deployment per dtype (context worker, generation worker, coordinator, aggregated server) on a
random Llama wide enough (hidden 256, GQA 8/2) that plain kernels would change bits with the batch;
the servers run with `--batch-invariant`. Requests of 5 to 250 tokens, widths 1 to 4, a third
sharing a 2-block prefix, are sent to the coordinator and the aggregated server at the same time
with staggered starts (they join and leave each other's batches). Every request's beams, token ids
and scores, must be identical: disaggregated under load, aggregated under load, and each alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from beamsplit.client.grpc_client import BeamsplitClient, GenerateResult, build_request
from beamsplit.launch.local_cluster import LocalCluster
from beamsplit.v1 import common_pb2, coordinator_pb2
from tests.helpers.clusters import assert_pools_empty, module_cluster
from tests.unit.test_batch_invariance import mixed_requests
from tests.unit.test_batch_invariance import model_dir as model_dir  # the same wide random Llama

NUM_REQUESTS = 16


@pytest.fixture(scope="module", params=["float32", "float64"])
def cluster(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    engine_arguments = [
        "--model",
        str(model_dir),
        "--dtype",
        request.param,
        "--num-blocks",
        "512",
        "--batch-invariant",
    ]
    yield from module_cluster(
        tmp_path_factory, f"concurrent-{request.param}", engine_arguments=engine_arguments
    )


def workload() -> list[coordinator_pb2.GenerateRequest]:
    """The engine test's mix (tests/unit/test_batch_invariance.py), as coordinator requests."""
    return [
        build_request(
            token_ids=prompt,
            sampling=common_pb2.SamplingOptions(
                beam_width=params.beam_width,
                max_new_tokens=params.max_new_tokens,
                ignore_eos=params.ignore_eos,
            ),
        )
        for _, prompt, params in mixed_requests()
    ]


def beams_of(result: GenerateResult) -> list[tuple[list[int], float, float, str]]:
    return [(list(b.token_ids), b.score, b.cumulative_logprob, b.finish_reason) for b in result.beams]


def test_sixteen_concurrent_requests_equal_their_runs_alone(cluster: LocalCluster) -> None:
    requests = workload()
    with (
        BeamsplitClient(cluster.coordinator.address) as coordinator,
        BeamsplitClient(cluster.aggregated.address) as aggregated,
    ):
        start = threading.Event()

        def send(client: BeamsplitClient, index: int) -> GenerateResult:
            start.wait(30.0)
            time.sleep(0.05 * (index % 8))  # staggered: requests join while others run and leave
            return client.generate(requests[index], timeout_s=300.0)

        with ThreadPoolExecutor(max_workers=2 * NUM_REQUESTS) as pool:
            disaggregated_futures = [pool.submit(send, coordinator, index) for index in range(NUM_REQUESTS)]
            aggregated_futures = [pool.submit(send, aggregated, index) for index in range(NUM_REQUESTS)]
            start.set()
            disaggregated_load = [beams_of(future.result(timeout=600.0)) for future in disaggregated_futures]
            aggregated_load = [beams_of(future.result(timeout=600.0)) for future in aggregated_futures]
        aggregated_alone = [beams_of(aggregated.generate(request, timeout_s=300.0)) for request in requests]
        disaggregated_alone = [
            beams_of(coordinator.generate(request, timeout_s=300.0)) for request in requests[:4]
        ]
    for index in range(NUM_REQUESTS):
        width = requests[index].sampling.beam_width
        assert len(aggregated_alone[index]) == width
        assert disaggregated_load[index] == aggregated_alone[index], (
            f"request {index}: disaggregated under load"
        )
        assert aggregated_load[index] == aggregated_alone[index], f"request {index}: aggregated under load"
    assert disaggregated_alone == aggregated_alone[:4]
    assert_pools_empty(cluster)
