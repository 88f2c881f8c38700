"""What a server says about itself to `GetLoad` and `GetStatus`: plain numbers from its metrics."""

from __future__ import annotations

from beamsplit.server.metrics import MetricsSnapshot, ServerMetrics
from beamsplit.v1 import common_pb2, coordinator_pb2


def worker_load(metrics: ServerMetrics, num_requests: int) -> common_pb2.WorkerLoad:
    snapshot = metrics.snapshot()
    return common_pb2.WorkerLoad(
        num_requests=num_requests,
        num_blocks_in_use=snapshot.num_blocks_in_use,
        num_blocks_total=snapshot.num_blocks_total,
        num_blocks_cached=snapshot.num_blocks_cached,
        # The scheduler's queue (aggregated) plus the admission queue (generation worker).
        num_waiting_requests=snapshot.num_waiting_requests + snapshot.num_queued_requests,
        prompt_tokens=snapshot.prompt_tokens,
        reused_tokens=snapshot.reused_tokens,
        transfer_blocks=snapshot.transfer_blocks,
        transfer_bytes=snapshot.transfer_bytes,
        transfer_failures=snapshot.transfer_failures,
        transfers_in_flight=snapshot.transfers_in_flight,
        lease_expiries=snapshot.lease_expiries,
        beam_tail_copies=snapshot.beam_tail_copies,
        requests_ok=_num_ok(snapshot),
        requests_failed=_num_failed(snapshot),
        requests_refused=_num_refused(snapshot),
        requests_cancelled=_num_cancelled(snapshot),
        kv_groups=[
            common_pb2.KVGroupLoad(name=name, num_blocks_in_use=in_use, num_blocks_total=total)
            for name, in_use, total in snapshot.kv_groups
        ],
    )


def server_status(
    metrics: ServerMetrics, num_in_flight: int, workers: list[coordinator_pb2.WorkerStatus]
) -> coordinator_pb2.StatusResponse:
    snapshot = metrics.snapshot()
    return coordinator_pb2.StatusResponse(
        role=metrics.role,
        requests_in_flight=num_in_flight,
        requests_ok=_num_ok(snapshot),
        requests_failed=_num_failed(snapshot),
        requests_refused=_num_refused(snapshot),
        requests_cancelled=_num_cancelled(snapshot),
        workers=workers,
    )


def self_status(
    metrics: ServerMetrics, address: str, info: common_pb2.WorkerInfo, num_in_flight: int
) -> coordinator_pb2.StatusResponse:
    """An aggregated server: it is its own (only) worker."""
    worker = coordinator_pb2.WorkerStatus(
        address=address,
        role=metrics.role,
        healthy=True,
        info=info,
        load=worker_load(metrics, num_in_flight),
    )
    return server_status(metrics, num_in_flight, [worker])


# The client's doing, not a fault: a bad request (400) or a full server (429).
REFUSED_OUTCOMES = frozenset({"invalid_argument", "resource_exhausted"})
CANCELLED_OUTCOME = "cancelled"


def _num_ok(snapshot: MetricsSnapshot) -> int:
    return snapshot.requests.get("ok", 0)


def _num_refused(snapshot: MetricsSnapshot) -> int:
    return sum(snapshot.requests.get(outcome, 0) for outcome in REFUSED_OUTCOMES)


def _num_cancelled(snapshot: MetricsSnapshot) -> int:
    return snapshot.requests.get(CANCELLED_OUTCOME, 0)


def _num_failed(snapshot: MetricsSnapshot) -> int:
    """Every other outcome: unavailable, aborted, deadline exceeded, internal errors."""
    not_failed = REFUSED_OUTCOMES | {"ok", CANCELLED_OUTCOME}
    return sum(count for outcome, count in snapshot.requests.items() if outcome not in not_failed)
