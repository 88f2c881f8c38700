"""`beamsplit serve generation`: wires the engine, the transfer agent and the servicer together."""

from __future__ import annotations

import argparse

from beamsplit.server.admission_queue import AdmissionLimits
from beamsplit.server.server_common import ShutdownGate
from beamsplit.server.worker_process import serve_worker, start_worker_parts
from beamsplit.server.worker_setup import KV_REGION_NAME, model_limits
from beamsplit.v1 import worker_pb2_grpc
from generation_worker.context_client import ContextClient
from generation_worker.service import GenerationService, GenerationTimeouts, LocalLayout
from generation_worker.servicer import GenerationWorkerServicer

SERVICE_NAME = "beamsplit.v1.GenerationWorker"


def run(args: argparse.Namespace) -> int:
    parts = start_worker_parts("generation", args)
    info, engine = parts.info, parts.handle.engine
    layout = LocalLayout(
        region_name=KV_REGION_NAME,
        tokens_per_block=info.tokens_per_block,
        page_bytes=info.page_bytes,
        region_pages=engine.kv_pool.region_pages,
        dtype=info.dtype,
        model=info.model,
    )
    gate = ShutdownGate()
    context_client = ContextClient(tls=parts.tls)
    service = GenerationService(
        parts.handle.loop,
        parts.agent,
        layout,
        context_client,
        parts.metrics,
        gate,
        GenerationTimeouts(pull_s=args.pull_timeout_s),
        pull_delay_s=parts.hooks.pull_delay_s,
        admission=AdmissionLimits(args.max_queued_requests, args.max_queue_wait_s),
    )
    servicer = GenerationWorkerServicer(
        service, gate, engine.tokenizer, model_limits(engine), info, parts.metrics
    )
    return serve_worker(
        parts,
        SERVICE_NAME,
        lambda grpc_server: worker_pb2_grpc.add_GenerationWorkerServicer_to_server(servicer, grpc_server),
        gate,
        after_engine_stop=context_client.close,
    )
