"""ServerMetrics: engine snapshots become gauges and counter increments; the snapshot GetLoad reads."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import generate_latest

from beamsplit.server.metrics import RequestTimer, ServerMetrics, read_samples
from beamsplit.server.status import server_status, worker_load
from engine.types import EngineCounters

ZERO = EngineCounters(
    num_blocks_total=8,
    num_blocks_in_use=0,
    num_blocks_cached=0,
    num_waiting_requests=0,
    num_running_requests=0,
    prompt_tokens=0,
    reused_tokens=0,
    beam_tail_copies=0,
    partial_reuse_copies=0,
)


def page(metrics: ServerMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_engine_counters_move_by_their_difference() -> None:
    metrics = ServerMetrics("generation")
    metrics.observe_counters(ZERO)
    metrics.observe_counters(replace(ZERO, num_blocks_in_use=5, num_waiting_requests=2, prompt_tokens=67))
    metrics.observe_counters(
        replace(ZERO, num_blocks_cached=3, prompt_tokens=134, reused_tokens=64, beam_tail_copies=3)
    )
    text = page(metrics)
    assert read_samples(text, "beamsplit_kv_blocks_capacity") == {"": 8.0}
    assert read_samples(text, "beamsplit_kv_blocks_in_use") == {"": 0.0}
    assert read_samples(text, "beamsplit_kv_blocks_cached") == {"": 3.0}
    assert read_samples(text, "beamsplit_scheduler_waiting_requests") == {"": 0.0}
    assert read_samples(text, "beamsplit_prefix_prompt_tokens_total") == {'side="generation"': 134.0}
    assert read_samples(text, "beamsplit_prefix_reused_tokens_total") == {'side="generation"': 64.0}
    copies = read_samples(text, "beamsplit_kv_block_copies_total")
    assert copies == {'reason="beam_tail"': 3.0, 'reason="partial_reuse"': 0.0}
    load = worker_load(metrics, num_requests=1)
    assert (load.num_blocks_total, load.num_blocks_cached, load.prompt_tokens, load.reused_tokens) == (
        8,
        3,
        134,
        64,
    )


def test_transfers_requests_and_latency() -> None:
    metrics = ServerMetrics("context")
    metrics.record_transfer(3, 3 * 1024, seconds=0.01)
    metrics.record_transfer_failure("lease_lapsed")
    metrics.record_lease_expiry()
    metrics.change_transfers_in_flight(2)
    metrics.change_transfers_in_flight(-1)
    metrics.count_request("ok")
    metrics.count_request("unavailable")
    timer = RequestTimer(metrics)
    timer.on_delta()
    timer.on_delta()
    timer.on_delta()
    timer.on_final()
    text = page(metrics)
    assert read_samples(text, "beamsplit_transfer_bytes_total") == {"": 3072.0}
    assert read_samples(text, "beamsplit_transfer_seconds_count") == {"": 1.0}
    assert read_samples(text, "beamsplit_transfer_failures_total")['reason="lease_lapsed"'] == 1.0
    assert read_samples(text, "beamsplit_lease_expiries_total") == {"": 1.0}
    assert read_samples(text, "beamsplit_transfers_in_flight") == {"": 1.0}
    assert read_samples(text, "beamsplit_time_to_first_token_seconds_count") == {"": 1.0}
    assert read_samples(text, "beamsplit_inter_token_latency_seconds_count") == {"": 2.0}
    assert read_samples(text, "beamsplit_e2e_latency_seconds_count") == {"": 1.0}
    load = worker_load(metrics, num_requests=0)
    assert (load.transfer_blocks, load.transfer_failures, load.lease_expiries, load.transfers_in_flight) == (
        3,
        1,
        1,
        1,
    )
    assert (load.requests_ok, load.requests_failed) == (1, 1)


def test_status_counts_refusals_and_cancels_apart_from_failures() -> None:
    metrics = ServerMetrics("coordinator")
    outcomes = ["ok"] * 3 + ["invalid_argument"] * 2 + ["resource_exhausted", "cancelled", "unavailable"]
    for outcome in [*outcomes, "aborted", "error"]:
        metrics.count_request(outcome)
    load = worker_load(metrics, num_requests=0)
    assert (load.requests_ok, load.requests_refused, load.requests_cancelled, load.requests_failed) == (
        3,
        3,
        1,
        3,
    )
    status = server_status(metrics, 0, [])
    assert (
        status.requests_ok,
        status.requests_refused,
        status.requests_cancelled,
        status.requests_failed,
    ) == (
        3,
        3,
        1,
        3,
    )


def test_kv_groups_show_blocks_per_attention_kind_and_window_pruned_tokens() -> None:
    # LLMEngine.counters: per attention kind the blocks in use (a kind's groups summed) and the one
    # shared pool's total.
    metrics = ServerMetrics("generation")
    grouped = replace(
        ZERO, group_names=("full", "window512"), group_blocks_total=(40, 40), group_blocks_in_use=(0, 0)
    )
    metrics.observe_counters(grouped)
    metrics.observe_counters(replace(grouped, group_blocks_in_use=(9, 15), window_pruned_tokens=96))
    text = page(metrics)
    assert read_samples(text, "beamsplit_kv_group_blocks_total") == {
        'group="full"': 40.0,
        'group="window512"': 40.0,
    }
    assert read_samples(text, "beamsplit_kv_group_blocks_in_use") == {
        'group="full"': 9.0,
        'group="window512"': 15.0,
    }
    assert read_samples(text, "beamsplit_prefix_window_pruned_tokens_total") == {'side="generation"': 96.0}
    load = worker_load(metrics, 1)
    assert [(group.name, group.num_blocks_in_use, group.num_blocks_total) for group in load.kv_groups] == [
        ("full", 9, 40),
        ("window512", 15, 40),
    ]


def test_status_prints_blocks_per_kv_group() -> None:
    from beamsplit.cli.status import format_status
    from beamsplit.v1 import common_pb2, coordinator_pb2

    metrics = ServerMetrics("generation")
    metrics.observe_counters(
        replace(
            ZERO, group_names=("full", "window8"), group_blocks_total=(40, 40), group_blocks_in_use=(9, 6)
        )
    )
    worker = coordinator_pb2.WorkerStatus(
        address="127.0.0.1:1", role="generation", healthy=True, load=worker_load(metrics, 1)
    )
    text = format_status("127.0.0.1:2", coordinator_pb2.StatusResponse(role="coordinator", workers=[worker]))
    assert "KV blocks in use per attention kind / the shared pool's total:" in text
    assert "127.0.0.1:1: full 9/40, window8 6/40" in text
    one_group = coordinator_pb2.WorkerStatus(
        address="a", role="generation", healthy=True, load=common_pb2.WorkerLoad()
    )
    assert "per attention kind" not in format_status(
        "t", coordinator_pb2.StatusResponse(role="coordinator", workers=[one_group])
    )
