"""`beamsplit serve context`: wires the engine, the transfer agent and the servicer together."""

from __future__ import annotations

import argparse

from beamsplit.server.admission_queue import AdmissionLimits
from beamsplit.server.server_common import ShutdownGate
from beamsplit.server.worker_process import serve_worker, start_worker_parts
from beamsplit.server.worker_setup import KV_REGION_NAME
from beamsplit.v1 import worker_pb2, worker_pb2_grpc
from context_worker.service import ContextService
from context_worker.servicer import ContextWorkerServicer

SERVICE_NAME = "beamsplit.v1.ContextWorker"


def run(args: argparse.Namespace) -> int:
    parts = start_worker_parts("context", args)
    info, metrics = parts.info, parts.metrics
    service = ContextService(
        parts.handle.loop,
        parts.agent,
        KV_REGION_NAME,
        metrics,
        default_lease_s=args.lease_s,
        page_bytes=info.page_bytes,
        prefill_delay_s=parts.hooks.prefill_delay_s,
        admission=AdmissionLimits(args.max_queued_requests, args.max_queue_wait_s),
    )
    layout = worker_pb2.PageLayout(
        region=KV_REGION_NAME,
        tokens_per_block=info.tokens_per_block,
        page_bytes=info.page_bytes,
        dtype=info.dtype,
        model=info.model,
    )
    gate = ShutdownGate()
    servicer = ContextWorkerServicer(service, gate, layout, info, metrics)
    return serve_worker(
        parts,
        SERVICE_NAME,
        lambda grpc_server: worker_pb2_grpc.add_ContextWorkerServicer_to_server(servicer, grpc_server),
        gate,
        before_engine_stop=service.shutdown,
    )
