"""What both workers' `run` do around their own service: the engine, transfer agent and metrics
before it; the gRPC server, the transfer watchdog, the announcement and a clean stop after it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from beamsplit.cli.engine_args import describe_kv_pool, engine_config_from_args
from beamsplit.server.core_lease import CoreLease
from beamsplit.server.fault_hooks import FaultHooks
from beamsplit.server.metrics import ServerMetrics
from beamsplit.server.server_common import (
    ShutdownGate,
    announce,
    configure_logging,
    run_until_signalled,
    start_grpc_server,
)
from beamsplit.server.tls import TlsConfig, tls_from_args
from beamsplit.server.worker_setup import (
    EngineHandle,
    TransferWatchdog,
    describe_transfer_agent,
    install_fault_hooks,
    start_engine,
    start_transfer_agent,
    worker_info,
)
from beamsplit.v1 import common_pb2
from transfer import UcxTransferAgent


@dataclass
class WorkerParts:
    role: str  # "context" or "generation"
    args: argparse.Namespace
    tls: TlsConfig | None
    metrics: ServerMetrics
    hooks: FaultHooks
    handle: EngineHandle
    agent: UcxTransferAgent
    info: common_pb2.WorkerInfo


def start_worker_parts(role: str, args: argparse.Namespace) -> WorkerParts:
    """Logging, TLS, metrics and fault hooks, then the engine on its loop thread and the transfer
    agent with the KV pool registered."""
    configure_logging(role)
    tls = tls_from_args(args)
    metrics = ServerMetrics(role)
    hooks = FaultHooks.from_environment()
    handle = start_engine(
        engine_config_from_args(args),
        metrics,
        step_delay_s=hooks.step_delay_s,
        core_lease=CoreLease(args.core_lease_file) if args.shares_cores else None,
    )
    agent = start_transfer_agent(handle, args, hooks)
    return WorkerParts(role, args, tls, metrics, hooks, handle, agent, worker_info(handle))


def serve_worker(
    parts: WorkerParts,
    service_name: str,
    add_servicer: Callable[[Any], None],
    gate: ShutdownGate,
    before_engine_stop: Callable[[], None] = lambda: None,
    after_engine_stop: Callable[[], None] = lambda: None,
) -> int:
    """Serves until a signal, then stops: the watchdog, before_engine_stop (the service's own
    drain), the engine, after_engine_stop (clients the service holds), the agent, the metrics."""
    args, engine = parts.args, parts.handle.engine
    server = start_grpc_server(
        args.host, args.port, add_servicer, gate, tls=parts.tls, max_message_mb=args.max_message_mb
    )
    parts.metrics.serve(args.metrics_port, args.host)
    server.set_serving([service_name])
    watchdog = TransferWatchdog(server, parts.agent, [service_name], args.transfer_watchdog_s).start()
    install_fault_hooks(parts.agent, parts.hooks)
    kv_pool = describe_kv_pool(engine.cache_config.num_blocks, engine.page_bytes, engine.cache_config)
    announce(
        parts.role, server, args.host, args.metrics_port, f"{describe_transfer_agent(parts.agent)}; {kv_pool}"
    )

    def cleanup() -> None:
        watchdog.stop()
        before_engine_stop()
        try:
            parts.handle.stop()
        finally:
            after_engine_stop()
            parts.agent.close()
            parts.metrics.close()

    # The workers keep the engine on a thread of its own (docs/service.md, "The engine thread"):
    # two worker processes on one host's cores did worse with the main thread's busy OpenMP pool.
    return run_until_signalled(server, cleanup, args.shutdown_grace_s)
