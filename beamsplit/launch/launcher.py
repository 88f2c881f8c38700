"""Starts `beamsplit serve ...` processes on loopback and stops them by pid, for the demo and the
integration tests. Every wait is bounded; a process that dies while starting is reported with
the tail of its log.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from beamsplit.server.metrics import read_gauge
from beamsplit.server.server_common import wait_until_healthy
from beamsplit.server.tls import TlsConfig

HOST = "127.0.0.1"  # the servers' default --host, which the launcher relies on rather than passes
WORKER_ROLES = ("context", "generation")
ENGINE_ROLES = ("context", "generation", "aggregated")
POOL_SIZING_FLAGS = ("--num-blocks", "--kv-cache-gib", "--kv-cache-fraction")
# Each engine's KV pool budget when its arguments do not size the pool: every process here shares
# this host's memory, so a small budget each (the tiny test model: 2048 pages in float64).
DEFAULT_LAUNCH_KV_CACHE_GIB = 0.0625


class PortPicker:
    """Hands out distinct ports below the kernel's ephemeral range that are free when handed out.

    A port the kernel picks (a bind to port 0) comes from the ephemeral range, where any process
    may take it between our probe and the server's bind, and UCX's tcp transport binds listeners
    there all the time: a server once died at start with "Address already in use". Below that
    range only explicit binds compete, and this picker never hands out the same port twice.
    """

    def __init__(self, host: str = HOST, span: int = 12000) -> None:
        self._host = host
        low = _ephemeral_port_low()
        self._candidates = range(max(1024, low - span), low)
        self._issued: set[int] = set()
        self._random = random.Random()

    def pick(self) -> int:
        for _ in range(200):
            port = self._random.choice(self._candidates)
            if port not in self._issued and _is_free(self._host, port):
                self._issued.add(port)
                return port
        raise RuntimeError(f"no free port found in {self._candidates}")


def _ephemeral_port_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class ServerProcess:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log_path: Path
    http_port: int = 0  # the OpenAI-compatible front's port; 0: none

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def http_url(self) -> str:
        """Base URL of the OpenAI-compatible API (for `openai.OpenAI(base_url=...)`)."""
        return f"http://{HOST}:{self.http_port}/v1"

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, num_lines: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def metric(self, name: str, timeout_s: float = 5.0) -> float | None:
        return read_gauge(self.metrics_text(timeout_s), name)

    def metrics_text(self, timeout_s: float = 5.0) -> str:
        """The whole /metrics page."""
        url = f"http://{HOST}:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text: str = response.read().decode()
            return text


class StoppableProcess(Protocol):
    name: str
    process: subprocess.Popen[bytes]

    @property
    def pid(self) -> int: ...

    def is_alive(self) -> bool: ...


def stop_processes(processes: Sequence[StoppableProcess], timeout_s: float = 15.0) -> dict[str, int | None]:
    """SIGTERM to every live process (reverse start order), then SIGKILL to any still running after
    `timeout_s`; exit codes by name."""
    for server in reversed(processes):
        if server.is_alive():
            os.kill(server.pid, signal.SIGTERM)
    codes: dict[str, int | None] = {}
    deadline = time.monotonic() + timeout_s
    for server in reversed(processes):
        try:
            codes[server.name] = server.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.kill(server.pid, signal.SIGKILL)
            codes[server.name] = server.process.wait(timeout=10.0)
    return codes


@dataclass
class ProcessGroup:
    """Processes started together and stopped together (SIGTERM, then SIGKILL after a bound)."""

    log_dir: Path
    processes: list[ServerProcess] = field(default_factory=list)
    ports: PortPicker = field(default_factory=PortPicker)
    tls: TlsConfig | None = None  # how health waits connect: a CA (and client cert) for TLS servers
    # Every process here runs on this host's cores: the engine processes (workers and aggregated
    # servers) get --shares-cores and take turns on them, a step each, through a lock file of this
    # group's (docs/service.md "The engine thread"). False where they never compute at the same
    # time (one request at a time, bench/service.py).
    workers_share_cores: bool = True
    # GiB per engine process, given as --kv-cache-gib unless its arguments size the pool themselves.
    kv_cache_gib: float = DEFAULT_LAUNCH_KV_CACHE_GIB

    def start(
        self,
        name: str,
        role: str,
        arguments: list[str],
        env: dict[str, str] | None = None,
        http: bool = False,
        same_ports_as: ServerProcess | None = None,
        http_port: int = 0,
    ) -> ServerProcess:
        """`http`: also serve the OpenAI-compatible front (coordinator and aggregated only), on
        `http_port` when given, else on a free port.
        `same_ports_as`: a stopped server this one replaces, on its ports (peers keep its address)."""
        if same_ports_as is not None:
            assert not same_ports_as.is_alive(), f"{same_ports_as.name} still runs"
            port, metrics_port = same_ports_as.port, same_ports_as.metrics_port
            http_port = same_ports_as.http_port
        else:
            port, metrics_port = self.ports.pick(), self.ports.pick()
            http_port = http_port or (self.ports.pick() if http else 0)
        http = http_port != 0
        http_arguments = ["--http-port", str(http_port)] if http else []
        command = [
            # No --host: every listener must bind loopback by default (tests/integration/test_security.py).
            sys.executable, "-m", "beamsplit.cli", "serve", role,
            "--port", str(port), "--metrics-port", str(metrics_port),
            *http_arguments, *arguments,
        ]  # fmt: skip
        if role in ENGINE_ROLES and self.workers_share_cores:
            command += ["--shares-cores", "--core-lease-file", str(self.log_dir / "cores.lock")]
        if role in ENGINE_ROLES and not any(flag in arguments for flag in POOL_SIZING_FLAGS):
            command += ["--kv-cache-gib", str(self.kv_cache_gib)]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        if same_ports_as is not None:
            self.processes.remove(same_ports_as)
            log_path = self.log_dir / f"{name}.{len(list(self.log_dir.glob(name + '.*log')))}.log"
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # a Ctrl-C in the terminal reaches the launcher, which stops us
            )
        server = ServerProcess(name, process, port, metrics_port, log_path, http_port)
        self.processes.append(server)
        return server

    def wait_healthy(self, server: ServerProcess, timeout_s: float) -> float:
        """Seconds it took; raises RuntimeError (with the log's tail) on death or timeout."""
        started = time.monotonic()
        if not wait_until_healthy(server.address, timeout_s, is_alive=server.is_alive, tls=self.tls):
            state = "exited" if not server.is_alive() else f"not healthy after {timeout_s:.0f} s"
            raise RuntimeError(f"{server.name} ({server.address}) {state}; log:\n{server.log_tail()}")
        return time.monotonic() - started

    def stop(self, server: ServerProcess, timeout_s: float = 15.0) -> int | None:
        if server.is_alive():
            os.kill(server.pid, signal.SIGTERM)
            try:
                return server.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(server.pid, signal.SIGKILL)
        return server.process.wait(timeout=timeout_s)

    def kill(self, server: ServerProcess) -> None:
        if server.is_alive():
            os.kill(server.pid, signal.SIGKILL)
        server.process.wait(timeout=10.0)

    def stop_all(self, timeout_s: float = 15.0) -> dict[str, int | None]:
        """Exit codes by name; stops in reverse start order (the front door first)."""
        return stop_processes(self.processes, timeout_s)
