"""A whole deployment on loopback, as separate processes: a context worker, a generation worker,
a coordinator in front of them, and an aggregated server as the reference. Used by the demo and
the integration tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from beamsplit.launch.launcher import DEFAULT_LAUNCH_KV_CACHE_GIB, ProcessGroup, ServerProcess
from beamsplit.server.tls import TlsConfig

DEFAULT_ENGINE_ARGUMENTS = ("--model", "tiny", "--dtype", "float64", "--tokens-per-block", "32")


@dataclass
class LocalCluster:
    group: ProcessGroup
    context: ServerProcess
    generation: ServerProcess
    coordinator: ServerProcess
    aggregated: ServerProcess

    @property
    def engine_servers(self) -> list[ServerProcess]:
        """The processes that own a KV pool."""
        return [self.context, self.generation, self.aggregated]

    def blocks_in_use(self) -> dict[str, float | None]:
        return {server.name: server.metric("beamsplit_kv_blocks_in_use") for server in self.engine_servers}

    def stop(self) -> dict[str, int | None]:
        return self.group.stop_all()


def start_local_cluster(
    log_dir: Path,
    engine_arguments: Sequence[str] = DEFAULT_ENGINE_ARGUMENTS,
    progress: Callable[[str], None] = lambda message: None,
    startup_timeout_s: float = 120.0,
    context_arguments: Sequence[str] = (),
    generation_arguments: Sequence[str] = (),
    coordinator_arguments: Sequence[str] = (),
    aggregated_arguments: Sequence[str] = (),
    http: bool = False,
    client_tls: TlsConfig | None = None,
    workers_share_cores: bool = True,
    http_port: int = 0,
    kv_cache_gib: float = DEFAULT_LAUNCH_KV_CACHE_GIB,
) -> LocalCluster:
    """Starts all four at once (they load the model in parallel) and waits for each to be healthy.

    `http`: the coordinator and the aggregated server also serve the OpenAI-compatible front
    (`ServerProcess.http_url`). `client_tls`: how the health waits reach servers started with TLS.
    `workers_share_cores`: ProcessGroup's (False only where the workers never compute at once).
    `http_port`: the coordinator's HTTP front on this port (implies `http`; 0: a free one).
    `kv_cache_gib`: each engine's KV pool budget unless its arguments size the pool.

    On any failure every process already started is stopped before the error propagates.
    """
    group = ProcessGroup(
        log_dir, tls=client_tls, workers_share_cores=workers_share_cores, kv_cache_gib=kv_cache_gib
    )
    http = http or http_port != 0
    try:
        started = time.monotonic()
        context = group.start("context", "context", [*engine_arguments, *context_arguments])
        generation = group.start("generation", "generation", [*engine_arguments, *generation_arguments])
        aggregated = group.start(
            "aggregated", "aggregated", [*engine_arguments, *aggregated_arguments], http=http
        )
        coordinator = group.start(
            "coordinator",
            "coordinator",
            ["--context", context.address, "--generation", generation.address, *coordinator_arguments],
            http=http,
            http_port=http_port,
        )
        for server in (context, generation, aggregated, coordinator):
            progress(f"starting {server.name:<11} pid {server.pid:<7} on {server.address} ...")
        for server in (context, generation, aggregated, coordinator):
            group.wait_healthy(server, max(1.0, startup_timeout_s - (time.monotonic() - started)))
            progress(f"{server.name:<11} healthy after {time.monotonic() - started:.1f} s")
    except BaseException:
        group.stop_all()
        raise
    return LocalCluster(group, context, generation, coordinator, aggregated)
