"""An interrupted `bench serve` replay ends its streams and exits within a bound.

`bench` turns SIGTERM into SystemExit; `replay` then cancels every stream it has open and closes
its channel on a bounded wait. The server here never answers, so only the cancellation can end the
streams: the test checks that the server sees every one of them end and that the client process
exits, both within seconds (the default request deadline is 15 minutes).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from beamsplit.v1 import coordinator_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
NUM_STREAMS = 4

CLIENT = """
import importlib.util, signal, sys
from pathlib import Path

def load(name):
    spec = importlib.util.spec_from_file_location(name, Path("bench") / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

def on_sigterm(signum, frame):
    raise SystemExit(143)

signal.signal(signal.SIGTERM, on_sigterm)
workload, clients = load("serve_workload"), load("serve_clients")
specs = [workload.RequestSpec(index, 0.0, (5, 6, 7), 2, 8, None) for index in range(int(sys.argv[2]))]
clients.replay(sys.argv[1], specs, workload.RequestRecord, lambda: None, "interrupt")
"""


class SilentCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Accepts Generate streams and never answers; counts the streams open and ended."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.opened = 0
        self.ended = 0

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 (gRPC's name)
        with self.condition:
            self.opened += 1
            self.condition.notify_all()
        deadline = time.monotonic() + 120.0
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(0.05)
        with self.condition:
            self.ended += 1
            self.condition.notify_all()
        return iter(())

    def wait_for(self, predicate: Any, timeout_s: float) -> bool:
        with self.condition:
            return bool(self.condition.wait_for(lambda: predicate(self), timeout=timeout_s))


def test_sigterm_mid_replay_cancels_every_stream_and_exits() -> None:
    servicer = SilentCoordinator()
    server = grpc.server(ThreadPoolExecutor(max_workers=NUM_STREAMS + 2))
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    process = subprocess.Popen(
        [sys.executable, "-c", CLIENT, f"127.0.0.1:{port}", str(NUM_STREAMS)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert servicer.wait_for(lambda s: s.opened == NUM_STREAMS, 60.0), "the streams never opened"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20.0) == 143
        assert servicer.wait_for(lambda s: s.ended == NUM_STREAMS, 10.0), (
            f"{servicer.ended} of {NUM_STREAMS} streams ended after the client's SIGTERM"
        )
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10.0)
        server.stop(grace=None)
