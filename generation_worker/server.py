"""`beamsplit serve generation`: wires the engine, the transfer agent and the servicer together."""

from __future__ import annotations

import argparse
import logging

from beamsplit.cli.engine_args import describe_kv_pool, engine_config_from_args
from beamsplit.server.admission_queue import AdmissionLimits
from beamsplit.server.fault_hooks import FaultHooks
from beamsplit.server.metrics import ServerMetrics
from beamsplit.server.server_common import (
    ShutdownGate,
    announce,
    configure_logging,
    run_until_signalled,
    start_grpc_server,
)
from beamsplit.server.tls import tls_from_args
from beamsplit.server.worker_setup import (
    KV_REGION_NAME,
    TransferWatchdog,
    describe_transfer_agent,
    install_fault_hooks,
    model_limits,
    start_engine,
    start_transfer_agent,
    worker_info,
)
from beamsplit.v1 import worker_pb2_grpc
from generation_worker.context_client import ContextClient
from generation_worker.service import GenerationService, GenerationTimeouts, LocalLayout
from generation_worker.servicer import GenerationWorkerServicer

logger = logging.getLogger(__name__)
SERVICE_NAME = "beamsplit.v1.GenerationWorker"


def run(args: argparse.Namespace) -> int:
    configure_logging("generation")
    tls = tls_from_args(args)
    metrics = ServerMetrics("generation")
    hooks = FaultHooks.from_environment()
    handle = start_engine(
        engine_config_from_args(args),
        metrics,
        step_delay_s=hooks.step_delay_s,
        shares_cores=args.shares_cores,
    )
    agent = start_transfer_agent(handle, args, hooks)
    info = worker_info(handle)
    layout = LocalLayout(
        region_name=KV_REGION_NAME,
        tokens_per_block=info.tokens_per_block,
        page_bytes=info.page_bytes,
        region_pages=handle.engine.kv_pool.region_pages,
        dtype=info.dtype,
        model=info.model,
    )
    gate = ShutdownGate()
    context_client = ContextClient(tls=tls)
    service = GenerationService(
        handle.loop,
        agent,
        layout,
        context_client,
        metrics,
        gate,
        GenerationTimeouts(pull_s=args.pull_timeout_s),
        pull_delay_s=hooks.pull_delay_s,
        admission=AdmissionLimits(args.max_queued_requests, args.max_queue_wait_s),
    )
    servicer = GenerationWorkerServicer(
        service, gate, handle.engine.tokenizer, model_limits(handle.engine), info, metrics
    )
    server = start_grpc_server(
        args.host,
        args.port,
        lambda grpc_server: worker_pb2_grpc.add_GenerationWorkerServicer_to_server(servicer, grpc_server),
        gate,
        tls=tls,
        max_message_mb=args.max_message_mb,
    )
    metrics.serve(args.metrics_port, args.host)
    server.set_serving([SERVICE_NAME])
    watchdog = TransferWatchdog(server, agent, [SERVICE_NAME], args.transfer_watchdog_s).start()
    install_fault_hooks(agent, hooks)
    announce(
        "generation",
        server,
        args.host,
        args.metrics_port,
        f"{describe_transfer_agent(agent)}; "
        + describe_kv_pool(
            handle.engine.cache_config.num_blocks, handle.engine.page_bytes, handle.engine.cache_config
        ),
    )

    def cleanup() -> None:
        watchdog.stop()
        try:
            handle.stop()
        finally:
            context_client.close()
            agent.close()
            metrics.close()

    # The workers keep the engine on a thread of its own (docs/service.md, "The engine thread"):
    # two worker processes on one host's cores did worse with the main thread's busy OpenMP pool.
    return run_until_signalled(server, cleanup, args.shutdown_grace_s)
