"""`beamsplit status --target HOST:PORT`: a one-screen summary of a running deployment.

It asks the coordinator (or an aggregated server) `GetStatus`: the server's own request counts,
then one row per worker as the coordinator's last probe saw it (health, load, KV pool, prefix
hit rate, transfers). A target that does not answer within `--timeout-s` is an error: one line
on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from beamsplit.cli import security_args
from beamsplit.server.tls import TlsConfig, open_channel, tls_from_args
from beamsplit.v1 import coordinator_pb2, coordinator_pb2_grpc

COLUMNS = ("WORKER", "ROLE", "HEALTH", "REQS", "QUEUED", "KV USED/CACHED/TOTAL", "HIT RATE", "TRANSFERS")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status",
        help="one-screen summary of a running deployment (workers, health, load, pools, hit rates)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", required=True, help="HOST:PORT of a coordinator or aggregated server")
    parser.add_argument(
        "--timeout-s", type=float, default=5.0, help="how long to wait for an answer (default: 5)"
    )
    parser.add_argument("--json", action="store_true", help="print the GetStatus reply as JSON")
    security_args.add_client_tls_arguments(parser)
    parser.set_defaults(handler=run)


def fetch_status(
    target: str, timeout_s: float, tls: TlsConfig | None = None, auth_token: str | None = None
) -> coordinator_pb2.StatusResponse:
    """Waits up to `timeout_s` for the target to answer; raises grpc.RpcError otherwise."""
    with open_channel(target, tls) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        response: coordinator_pb2.StatusResponse = stub.GetStatus(
            coordinator_pb2.StatusRequest(),
            timeout=timeout_s,
            wait_for_ready=True,
            metadata=security_args.bearer_metadata(auth_token),
        )
        return response


def run(args: argparse.Namespace) -> int:
    try:
        status = fetch_status(
            args.target, args.timeout_s, tls_from_args(args), security_args.load_token(args)
        )
    except grpc.RpcError as error:
        code = error.code()
        reason = (
            f"no answer within {args.timeout_s:g} s (is it running?)"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED
            else f"{code.name}: {error.details()}"
        )
        print(f"beamsplit status: cannot reach {args.target}: {reason}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(MessageToDict(status, preserving_proto_field_name=True), indent=2))
    else:
        print(format_status(args.target, status))
    return 0


def format_status(target: str, status: coordinator_pb2.StatusResponse) -> str:
    num_healthy = sum(1 for worker in status.workers if worker.healthy)
    lines = [
        f"{status.role} {target}: {status.requests_in_flight} in flight, {status.requests_ok} ok, "
        f"{status.requests_refused} refused (400/429), {status.requests_cancelled} cancelled, "
        f"{status.requests_failed} failed; {num_healthy}/{len(status.workers)} workers healthy",
    ]
    model = next((worker.info for worker in status.workers if worker.HasField("info")), None)
    if model is not None:
        lines.append(
            f"model {model.model} ({model.dtype}), block {model.tokens_per_block} tokens, "
            f"{_bytes(model.page_bytes)}/page"
        )
    rows = [COLUMNS, *(_row(worker) for worker in status.workers)]
    widths = [max(len(row[index]) for row in rows) for index in range(len(COLUMNS))]
    lines.append("")
    lines.extend(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )
    groups = [
        f"  {worker.address}: "
        + ", ".join(
            f"{group.name} {group.num_blocks_in_use}/{group.num_blocks_total}"
            for group in worker.load.kv_groups
        )
        for worker in status.workers
        if len(worker.load.kv_groups) > 1
    ]
    if groups:
        lines.extend(["", "KV blocks in use per attention kind / the shared pool's total:", *groups])
    details = [f"  {worker.address}: {worker.detail}" for worker in status.workers if worker.detail]
    if details:
        lines.extend(["", "unhealthy:", *details])
    return "\n".join(lines)


def _row(worker: coordinator_pb2.WorkerStatus) -> tuple[str, ...]:
    load = worker.load
    hit_rate = (
        f"{load.reused_tokens}/{load.prompt_tokens} {100.0 * load.reused_tokens / load.prompt_tokens:.0f}%"
        if load.prompt_tokens
        else "-"
    )
    if worker.role == "aggregated":
        transfers = "-"
    else:
        transfers = (
            f"{load.transfer_blocks} pages {_bytes(load.transfer_bytes)}, {load.transfers_in_flight} live, "
            f"{load.transfer_failures} failed"
        )
        if worker.role == "context":
            transfers += f", {load.lease_expiries} leases lapsed"
    return (
        worker.address,
        worker.role,
        "healthy" if worker.healthy else "DOWN",
        str(load.num_requests),
        str(load.num_waiting_requests),
        f"{load.num_blocks_in_use}/{load.num_blocks_cached}/{load.num_blocks_total}",
        hit_rate,
        transfers,
    )


def _bytes(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
