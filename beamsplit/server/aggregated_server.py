"""`beamsplit serve aggregated`: the client API served by one engine, prefill and decode together."""

from __future__ import annotations

import argparse
import logging

from beamsplit.cli.engine_args import describe_kv_pool, engine_config_from_args
from beamsplit.cli.security_args import load_token
from beamsplit.server.aggregated import AggregatedService
from beamsplit.server.client_api_servicer import ClientApiServicer
from beamsplit.server.core_lease import CoreLease
from beamsplit.server.fault_hooks import FaultHooks
from beamsplit.server.http_front import OpenAIFront, start_http_front
from beamsplit.server.metrics import ServerMetrics
from beamsplit.server.server_common import (
    ShutdownGate,
    announce,
    configure_logging,
    run_until_signalled,
    start_grpc_server,
)
from beamsplit.server.status import self_status
from beamsplit.server.tls import tls_from_args
from beamsplit.server.worker_setup import model_limits, start_engine, worker_info
from beamsplit.v1 import coordinator_pb2_grpc
from engine.scheduler import QueueLimits

logger = logging.getLogger(__name__)
SERVICE_NAME = "beamsplit.v1.Coordinator"


def run(args: argparse.Namespace) -> int:
    configure_logging("aggregated")
    tls = tls_from_args(args)
    auth_token = load_token(args)
    metrics = ServerMetrics("aggregated")
    # The aggregated server's queue is its scheduler's: requests wait there for blocks or batch room.
    queue_limits = QueueLimits(max_num_waiting=args.max_queued_requests, max_wait_s=args.max_queue_wait_s)
    handle = start_engine(
        engine_config_from_args(args),
        metrics,
        queue_limits,
        run_in_caller=True,
        step_delay_s=FaultHooks.from_environment().step_delay_s,
        core_lease=CoreLease(args.core_lease_file) if args.shares_cores else None,
    )
    gate = ShutdownGate()
    limits = model_limits(handle.engine)
    service = AggregatedService(handle.loop, handle.engine.tokenizer, limits, gate)
    info = worker_info(handle)
    servicer = ClientApiServicer(
        service,
        gate,
        metrics,
        "aggregated server",
        status=lambda: self_status(metrics, f"{args.host}:{server.port}", info, gate.num_in_flight),
    )
    server = start_grpc_server(
        args.host,
        args.port,
        lambda grpc_server: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, grpc_server),
        gate,
        tls=tls,
        auth_token=auth_token,
        max_message_mb=args.max_message_mb,
    )
    front = OpenAIFront(
        service,
        handle.engine.tokenizer,
        args.model,
        limits.max_model_len,
        gate,
        metrics,
        "aggregated server",
        max_body_mb=args.http_max_body_mb,
    )
    http_server = start_http_front(front, args.host, args.http_port, tls, auth_token)
    metrics.serve(args.metrics_port, args.host)
    server.set_serving([SERVICE_NAME])
    http = f", http http://{args.host}:{http_server.port}/v1" if http_server else ""
    announce(
        "aggregated",
        server,
        args.host,
        args.metrics_port,
        f"{http}; "
        + describe_kv_pool(
            handle.engine.cache_config.num_blocks, handle.engine.page_bytes, handle.engine.cache_config
        ),
    )

    def cleanup() -> None:
        try:
            if http_server is not None:
                http_server.stop()
            handle.stop()
        finally:
            metrics.close()

    return run_until_signalled(server, cleanup, args.shutdown_grace_s, run_in_main=handle.loop.run_here)
