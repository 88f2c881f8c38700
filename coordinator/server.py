"""`beamsplit serve coordinator`: the client-facing front door over pools of workers."""

from __future__ import annotations

import argparse
import logging
import sys

from beamsplit.cli.security_args import load_token
from beamsplit.server.client_api_servicer import ClientApiServicer
from beamsplit.server.http_front import OpenAIFront, start_http_front
from beamsplit.server.metrics import ServerMetrics
from beamsplit.server.request_validation import ModelLimits
from beamsplit.server.server_common import (
    ShutdownGate,
    announce,
    configure_logging,
    run_until_signalled,
    start_grpc_server,
)
from beamsplit.server.status import server_status
from beamsplit.server.tls import tls_from_args
from beamsplit.v1 import common_pb2, coordinator_pb2_grpc, worker_pb2_grpc
from coordinator.service import CoordinatorService, CoordinatorSettings
from coordinator.worker_pool import WorkerPool
from engine.models.loader import load_model_tokenizer

logger = logging.getLogger(__name__)
SERVICE_NAME = "beamsplit.v1.Coordinator"


def _split(addresses: str) -> list[str]:
    return [address.strip() for address in addresses.split(",") if address.strip()]


def run(args: argparse.Namespace) -> int:
    configure_logging("coordinator")
    tls = tls_from_args(args)  # our listeners' certificate, and the CA and client cert to reach workers
    auth_token = load_token(args)
    metrics = ServerMetrics("coordinator")
    context_pool = WorkerPool(
        "context",
        _split(args.context),
        worker_pb2_grpc.ContextWorkerStub,
        tls=tls,
        affinity_slack=args.prefix_affinity_slack,
    )
    generation_pool = WorkerPool(
        "generation",
        _split(args.generation),
        worker_pb2_grpc.GenerationWorkerStub,
        tls=tls,
        affinity_slack=args.prefix_affinity_slack,
    )
    context_pool.start()
    generation_pool.start()
    infos: list[common_pb2.WorkerInfo] = []
    for pool in (context_pool, generation_pool):
        info = pool.wait_for_info(args.wait_for_workers_s)
        if info is None:
            print(
                f"[coordinator] no {pool.kind} worker answered within {args.wait_for_workers_s:.0f} s",
                file=sys.stderr,
            )
            context_pool.close()
            generation_pool.close()
            return 1
        infos.append(info)
    fleet_info = infos[0]
    for pool in (context_pool, generation_pool):
        pool.set_expected_info(fleet_info)
    model_name = args.model or fleet_info.model
    tokenizer = load_model_tokenizer(model_name)
    limits = ModelLimits(
        vocab_size=fleet_info.vocab_size,
        max_model_len=fleet_info.max_model_len,
        eos_token_id=fleet_info.eos_token_id if fleet_info.HasField("eos_token_id") else None,
    )
    settings = CoordinatorSettings(
        max_attempts=max(1, args.max_attempts),
        lease_s=args.lease_s,
        tokens_per_block=fleet_info.tokens_per_block,
        prefill_timeout_s=args.prefill_timeout_s,
    )
    service = CoordinatorService(context_pool, generation_pool, tokenizer, limits, settings)
    gate = ShutdownGate()
    servicer = ClientApiServicer(
        service,
        gate,
        metrics,
        "coordinator",
        status=lambda: server_status(
            metrics, gate.num_in_flight, context_pool.statuses() + generation_pool.statuses()
        ),
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
        tokenizer,
        model_name,
        limits.max_model_len,
        gate,
        metrics,
        "coordinator",
        max_body_mb=args.http_max_body_mb,
        unready_reason=lambda: unready_reason(context_pool, generation_pool),
    )
    http_server = start_http_front(front, args.host, args.http_port, tls, auth_token)
    metrics.serve(args.metrics_port, args.host)
    server.set_serving([SERVICE_NAME])
    http = f", http http://{args.host}:{http_server.port}/v1" if http_server else ""
    announce("coordinator", server, args.host, args.metrics_port, http)

    def cleanup() -> None:
        if http_server is not None:
            http_server.stop()
        context_pool.close()
        generation_pool.close()
        metrics.close()

    return run_until_signalled(server, cleanup, args.shutdown_grace_s)


def unready_reason(context_pool: WorkerPool, generation_pool: WorkerPool) -> str | None:
    """Why no request can be served now: a kind of worker with none healthy (None: all is well)."""
    for pool in (context_pool, generation_pool):
        if pool.num_healthy() == 0:
            return f"no healthy {pool.kind} worker"
    return None
