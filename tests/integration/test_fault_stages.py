"""Client cancels and deadlines at each stage of a request: queued, prefilling, pulling, decoding.

The test hooks hold every request at each stage (fault_matrix_helpers), and the tests find the
stage from the workers' metrics, not from sleeps. After each: nothing held on any worker within
the bound, and the next request is served (docs/faults.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from beamsplit.client.grpc_client import BeamsplitClient, build_request
from beamsplit.launch.launcher import ProcessGroup
from tests.integration.fault_matrix_helpers import (
    LONG,
    PREFILL_DELAY_S,
    PROMPT,
    PULL_DELAY_S,
    SERVE_DELAY_S,
    SHORT,
    HookedDeployment,
    assert_serves,
    busy_generation,
    metric,
    outcome,
    start_hooked_deployment,
    wait_clean,
    wait_until,
)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HookedDeployment]:
    group = ProcessGroup(tmp_path_factory.mktemp("fault-stages"))
    try:
        yield start_hooked_deployment(group)
    finally:
        codes = group.stop_all()
    assert set(codes.values()) == {0}, codes


def queued_behind_another(deployment: HookedDeployment, client: BeamsplitClient) -> threading.Thread:
    """Starts a request that holds the context worker's engine thread (its prefill is delayed)."""
    first_ok: list[bool] = []

    def run_first() -> None:
        result = client.generate(build_request(token_ids=[*PROMPT, 1], sampling=SHORT), timeout_s=30.0)
        first_ok.append(len(result.beams) == 2)

    thread = threading.Thread(target=run_first)
    thread.start()
    thread.first_ok = first_ok  # type: ignore[attr-defined]
    return thread


def failure_counter(deployment: HookedDeployment, reason: str) -> float:
    text = "".join(server.metrics_text() for server in deployment.generations)
    total = 0.0
    for line in text.splitlines():
        if line.startswith("beamsplit_transfer_failures_total{") and f'reason="{reason}"' in line:
            total += float(line.split()[-1])
    return total


@pytest.mark.parametrize("how", ["cancel", "deadline"])
@pytest.mark.parametrize("stage", ["queued", "prefilling", "pulling", "decoding"])
def test_request_ended_at_each_stage_leaves_nothing_held(
    deployment: HookedDeployment, stage: str, how: str
) -> None:
    # Deadlines fall in the middle of the stage's window (the hooks hold each stage open).
    deadline_s = {
        "queued": PREFILL_DELAY_S / 2,  # from its arrival while another prefill holds the engine
        "prefilling": PREFILL_DELAY_S / 2,
        "pulling": PREFILL_DELAY_S + PULL_DELAY_S + SERVE_DELAY_S / 2,
        "decoding": PREFILL_DELAY_S + PULL_DELAY_S + SERVE_DELAY_S + 1.5,
    }[stage]
    cancelled_pulls = failure_counter(deployment, "cancelled")
    with BeamsplitClient(deployment.coordinator.address) as client:
        first = None
        if stage == "queued":
            first = queued_behind_another(deployment, client)
            time.sleep(0.2)  # the first request's prefill has reached the engine thread
        sampling = LONG if stage == "decoding" else SHORT
        call = client.stream(
            build_request(token_ids=PROMPT, sampling=sampling),
            timeout_s=deadline_s if how == "deadline" else 60.0,
        )
        responses = iter(call)
        started = time.monotonic() + deadline_s  # when the deadline passes
        if how == "cancel":
            if stage == "queued":
                wait_until(
                    lambda: metric(deployment.context, "beamsplit_engine_queued_commands") >= 1, 5.0, "queued"
                )
            elif stage == "prefilling":
                time.sleep(PREFILL_DELAY_S / 2)
                assert all(
                    metric(server, "beamsplit_kv_blocks_in_use") == 0 for server in deployment.generations
                )
            elif stage == "pulling":
                busy_generation(deployment, pulls=True)
            else:
                assert next(responses).HasField("delta")
            call.cancel()  # type: ignore[attr-defined]
            started = time.monotonic()
        num_deltas = 1 if how == "cancel" and stage == "decoding" else 0
        with pytest.raises(grpc.RpcError) as raised:
            for response in responses:
                num_deltas += response.HasField("delta")
        assert (num_deltas > 0) == (stage == "decoding"), num_deltas
        expected = grpc.StatusCode.CANCELLED if how == "cancel" else grpc.StatusCode.DEADLINE_EXCEEDED
        assert raised.value.code() == expected, raised.value.details()
        if first is not None:
            first.join(timeout=30.0)
            assert first.first_ok == [True]  # type: ignore[attr-defined]
            started = time.monotonic()  # the request it queued behind is done: nothing may be held
    wait_clean(deployment, f"{how} while {stage}", started, outcome(raised.value))
    if stage == "pulling":  # the pull really was running, and was stopped
        assert failure_counter(deployment, "cancelled") == cancelled_pulls + 1
    assert_serves(deployment)
