"""The coordinator's /health says 503 while some kind of worker has none healthy."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from beamsplit.v1 import worker_pb2_grpc
from coordinator.server import unready_reason
from coordinator.worker_pool import WorkerPool


@pytest.fixture
def pools() -> Iterator[tuple[WorkerPool, WorkerPool]]:
    # Never started: no probes; health is set by hand below. Addresses are never dialled.
    context = WorkerPool("context", ["127.0.0.1:1", "127.0.0.1:2"], worker_pb2_grpc.ContextWorkerStub)
    generation = WorkerPool("generation", ["127.0.0.1:3"], worker_pb2_grpc.GenerationWorkerStub)
    yield context, generation
    context.close()
    generation.close()


def test_ready_only_with_a_healthy_worker_of_each_kind(pools: tuple[WorkerPool, WorkerPool]) -> None:
    context, generation = pools
    assert unready_reason(context, generation) == "no healthy context worker"
    context.workers[1].is_healthy = True
    assert unready_reason(context, generation) == "no healthy generation worker"
    generation.workers[0].is_healthy = True
    assert unready_reason(context, generation) is None
    context.mark_unhealthy(context.workers[1], "probe failed")
    assert unready_reason(context, generation) == "no healthy context worker"
