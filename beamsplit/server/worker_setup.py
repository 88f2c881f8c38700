"""Building blocks every engine-owning server needs: its engine config, the engine on its loop thread,
the worker's self-description, and its transfer agent with the KV pool registered.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from beamsplit.server.core_lease import CoreLease
from beamsplit.server.engine_loop import EngineLoop
from beamsplit.server.fault_hooks import FaultHooks
from beamsplit.server.metrics import ServerMetrics
from beamsplit.server.request_validation import ModelLimits
from beamsplit.server.server_common import GrpcServer
from beamsplit.v1 import common_pb2
from engine.config import EngineConfig
from engine.scheduler import QueueLimits
from transfer import MemoryRegion, TransferAgent, UcxTransferAgent

WARM_UP_TIMEOUT_S = 600.0  # kernel checks on the loop thread: seconds on a slow host, bounded
WARM_UP_TURN_BOUND_S = 120.0  # the other engine processes' warm-ups; past it this one warms up anyway

KV_REGION_NAME = "kv"
logger = logging.getLogger(__name__)


@dataclass
class EngineHandle:
    engine: Any  # engine.LLMEngine; only the loop thread calls it after start
    loop: EngineLoop
    config: EngineConfig

    def stop(self) -> None:
        """Logs the blocks still held (0 after a clean drain; tests read it) and stops the loop."""
        try:
            remaining = self.loop.call(lambda engine: engine.num_blocks_in_use(), timeout_s=10.0)
            logger.info("blocks in use at exit: %d", remaining)
        finally:
            self.loop.stop()


class ModelLoadError(Exception):
    """`--model` could not be loaded; the message is one line naming the file and the reason."""


def start_engine(
    config: EngineConfig,
    metrics: ServerMetrics,
    queue_limits: QueueLimits | None = None,
    run_in_caller: bool = False,
    step_delay_s: float = 0.0,
    core_lease: CoreLease | None = None,
) -> EngineHandle:
    """queue_limits: bounds on the scheduler's waiting queue (the aggregated server's queue).
    run_in_caller: the loop takes commands now, and the caller's thread (which loaded the model)
    runs it later with `handle.loop.run_here()`; otherwise it starts on a thread of its own.
    step_delay_s: the test hook of that name (FaultHooks). core_lease: other engine processes (the
    other worker of a one-host deployment, an aggregated server beside them) compute on the same
    cores: the warm-up and each step wait for this process's turn on them (core_lease.py)."""
    import torch

    from beamsplit.cli.thread_wait import describe_wait_policy
    from engine import LLMEngine

    num_threads = torch.get_num_threads()
    logger.info("%d threads; %s", num_threads, describe_wait_policy(os.environ))
    # torch's OpenMP pool belongs to the thread that calls into it. A loop on a thread of its own
    # gets the process's threads, and the main thread loads the model with one (no pool), so the
    # process holds one pool whose threads spin at its barriers: a decode step as fast as on the
    # aggregated server, whose loop runs on the main thread. Workers sharing their cores do the
    # same and take turns on them (docs/service.md, "The engine thread").
    one_pool = not run_in_caller
    if one_pool:
        torch.set_num_threads(1)
    try:
        # One pool: the loop thread warms up (the kernel checks are for its thread count).
        # With a core lease the warm-up waits for its turn, below.
        engine = LLMEngine(config, queue_limits, warm_up=not one_pool and core_lease is None)
    except (OSError, ValueError) as error:  # missing files, bad checkpoints, refused formats
        raise ModelLoadError(f"cannot load --model {config.model}: {error}") from error
    config = engine.config  # the pool size is settled once the model is loaded
    metrics.kv_blocks_total.set(config.cache.num_blocks)
    metrics.observe_engine(engine)
    loop = EngineLoop(
        engine,
        on_iteration=metrics.observe_engine,
        step_delay_s=step_delay_s,
        run_in_caller=run_in_caller,
        on_thread_start=(lambda: torch.set_num_threads(num_threads)) if one_pool else None,
        core_lease=core_lease,
    )
    metrics.engine_commands.set_function(lambda: loop.num_pending_commands)
    if core_lease is not None:
        metrics.core_turns_skipped.set_function(lambda: core_lease.turns_skipped)
    if run_in_caller and core_lease is not None:
        _warm_up(engine, core_lease)  # the caller's thread computes: its one pool
    if not run_in_caller:
        loop.start()
        if one_pool:
            # The loop thread computes with num_threads: the checks and the packing run there
            # before anyone is told the engine is ready (engine/packed_linear.py).
            loop.call(lambda engine: _warm_up(engine, core_lease), timeout_s=WARM_UP_TIMEOUT_S)
    return EngineHandle(engine=engine, loop=loop, config=config)


def _warm_up(engine: Any, core_lease: CoreLease | None) -> None:
    """engine.warm_up(), in a turn on shared cores: two workers warming up side by side, their
    threads spinning at barriers (thread_wait.py's TURN_SPIN), took 19-20 s to start against 14-15."""
    with nullcontext() if core_lease is None else core_lease.turn(WARM_UP_TURN_BOUND_S):
        engine.warm_up()


def model_limits(engine: Any) -> ModelLimits:
    """Read before the loop starts, or from values that never change afterwards."""
    return ModelLimits(
        vocab_size=int(engine.model_config.vocab_size),
        max_model_len=int(engine.model_config.max_position_embeddings),
        eos_token_id=engine.tokenizer.eos_token_id,
    )


def worker_info(handle: EngineHandle) -> common_pb2.WorkerInfo:
    engine = handle.engine
    info = common_pb2.WorkerInfo(
        model=handle.config.model,
        dtype=handle.config.dtype,
        tokens_per_block=handle.config.cache.tokens_per_block,
        vocab_size=int(engine.model_config.vocab_size),
        max_model_len=int(engine.model_config.max_position_embeddings),
        num_blocks=handle.config.cache.num_blocks,
        page_bytes=int(engine.kv_region().page_bytes),
    )
    if engine.tokenizer.eos_token_id is not None:
        info.eos_token_id = engine.tokenizer.eos_token_id
    return info


def start_transfer_agent(
    handle: EngineHandle, args: argparse.Namespace, hooks: FaultHooks | None = None
) -> UcxTransferAgent:
    """A UCX agent with the engine's whole KV pool registered as `KV_REGION_NAME`.

    Its control listener binds the server's --host (port --transfer-port, 0: any free one); peers
    are told --advertise-host when given (a pod IP behind a wildcard bind)."""
    region = handle.engine.kv_region()
    agent = UcxTransferAgent(
        host=args.host,
        port=args.transfer_port,
        advertise_host=args.advertise_host,
        lanes=args.transfer_lanes,
        serve_delay_s=hooks.serve_delay_s if hooks is not None else 0.0,
    )
    agent.register(
        KV_REGION_NAME,
        MemoryRegion(
            address=region.address,
            page_bytes=region.page_bytes,
            num_pages=region.num_pages,
            device=region.device,
        ),
    )
    return agent


def describe_transfer_agent(agent: UcxTransferAgent) -> str:
    """The tail of a worker's "serving on" line: where pulls reach it and how it moves pages."""
    return f", ucx {agent.address} ({agent.binding_name}, {agent.num_lanes} receive lanes)"


class TransferWatchdog:
    """Health follows the transfer layer: NOT_SERVING while the agent's event loop has not come
    round for `bound_s` (a wedged UCX call), SERVING again once it does. Runs on its own timer, so a
    wedged worker is reported with no traffic at all, within `bound_s` plus one period."""

    PERIOD_S = 0.25

    def __init__(
        self, server: GrpcServer, agent: TransferAgent, service_names: list[str], bound_s: float
    ) -> None:
        self._server = server
        self._agent = agent
        self._service_names = service_names
        self._bound_s = bound_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="transfer-watchdog", daemon=True)

    def start(self) -> TransferWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=2.0)

    def _watch(self) -> None:
        is_serving = True
        last_turn = time.monotonic()
        while not self._stopping.wait(self.PERIOD_S):
            # A watchdog that itself woke late saw the whole process paused (SIGSTOP, a swap
            # storm): the loop had no chance to run either, so this turn judges nothing.
            now, was_paused = time.monotonic(), time.monotonic() - last_turn > self._bound_s
            last_turn = now
            age_s = self._agent.loop_age_s()
            if was_paused:
                continue
            is_wedged = age_s > self._bound_s
            if is_wedged == is_serving:
                is_serving = not is_wedged
                if is_wedged:
                    logger.error("transfer agent's event loop stuck for %.1f s: health NOT_SERVING", age_s)
                else:
                    logger.warning("transfer agent's event loop runs again: health SERVING")
                self._server.set_serving(self._service_names, is_serving)


def install_fault_hooks(agent: UcxTransferAgent, hooks: FaultHooks) -> None:
    """Test only (docs/faults.md): SIGUSR1 wedges the transfer agent's loop for an hour."""
    if hooks.is_wedge_on_sigusr1:
        signal.signal(signal.SIGUSR1, lambda *_: agent.stall_loop_for_test(3600.0))
