"""What every beamsplit gRPC server shares: health service, drain-on-SIGTERM, health probes.

Shutdown order on SIGTERM (or SIGINT): health turns NOT_SERVING and new calls are refused with
UNAVAILABLE; in-flight calls get `grace_s` to finish; whatever is still running is failed with
UNAVAILABLE "server shutting down"; then the role's own cleanup runs (abort engine requests,
release every pinned page, close the transfer agent) and the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from beamsplit.server.auth import BearerTokenInterceptor
from beamsplit.server.decode_guard import DecodeGuardInterceptor
from beamsplit.server.log_context import RequestIdFilter
from beamsplit.server.tls import TlsConfig, open_channel

logger = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "server shutting down"
# gRPC's own default; a larger request is refused by gRPC itself with RESOURCE_EXHAUSTED.
DEFAULT_MAX_MESSAGE_MB = 4.0
# Threads serving calls. A streaming Generate holds one for its whole life, so this also bounds
# the streams one server serves at once; the HTTP front (256 at most) runs on threads of its own.
DEFAULT_MAX_WORKERS = 512


class ShutdownGate:
    """Counts in-flight calls so that a shutdown can drain them, then fail the stragglers."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._num_in_flight = 0
        self._is_draining = False
        self._is_aborting = threading.Event()

    def enter(self) -> bool:
        """False once draining has begun: the caller must refuse the call."""
        with self._condition:
            if self._is_draining:
                return False
            self._num_in_flight += 1
            return True

    def exit(self) -> None:
        with self._condition:
            self._num_in_flight -= 1
            self._condition.notify_all()

    @property
    def num_in_flight(self) -> int:
        with self._condition:
            return self._num_in_flight

    @property
    def is_draining(self) -> bool:
        """True from the start of `drain`: new calls are refused (and /health answers 503)."""
        with self._condition:
            return self._is_draining

    @property
    def is_aborting(self) -> bool:
        """In-flight loops poll this and fail with UNAVAILABLE once it is set."""
        return self._is_aborting.is_set()

    def drain(self, grace_s: float) -> bool:
        """Refuses new calls, waits up to `grace_s` for in-flight ones; True if all finished."""
        deadline = time.monotonic() + grace_s
        with self._condition:
            self._is_draining = True
            while self._num_in_flight > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._condition.wait(remaining)
        return True

    def abort_in_flight(self, wait_s: float) -> None:
        self._is_aborting.set()
        deadline = time.monotonic() + wait_s
        with self._condition:
            while self._num_in_flight > 0 and time.monotonic() < deadline:
                self._condition.wait(max(0.0, deadline - time.monotonic()))


@dataclass
class GrpcServer:
    server: grpc.Server
    health: health.HealthServicer
    port: int
    gate: ShutdownGate

    def set_serving(self, service_names: Iterable[str], is_serving: bool = True) -> None:
        """SERVING or NOT_SERVING for the server and each named service; a no-op once shutting down."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if is_serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *service_names]:
            self.health.set(name, status)


def start_grpc_server(
    host: str,
    port: int,
    register: Callable[[grpc.Server], None],
    gate: ShutdownGate,
    max_workers: int = DEFAULT_MAX_WORKERS,
    max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
    tls: TlsConfig | None = None,
    auth_token: str | None = None,
) -> GrpcServer:
    """Binds (port 0 picks a free one), registers the role's servicers plus health, and starts.

    Requests larger than `max_message_mb` are refused by gRPC (RESOURCE_EXHAUSTED); undecodable
    ones answer INVALID_ARGUMENT (`decode_guard`). With `tls` holding a certificate the port speaks
    TLS only (mutual when it requires client certs); with `auth_token` every call but the health
    service needs the bearer token (checked before anything is decoded).
    """
    interceptors: list[grpc.ServerInterceptor] = [BearerTokenInterceptor(auth_token)] if auth_token else []
    interceptors.append(DecodeGuardInterceptor())
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        maximum_concurrent_rpcs=max_workers,  # beyond: RESOURCE_EXHAUSTED at once, never an unbounded queue
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", int(max_message_mb * 1024 * 1024))],
    )
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    # grpcio's servicer starts the server-wide status ("") at SERVING: a launcher or probe polling
    # it would call a coordinator healthy before its workers answer and its HTTP front listens.
    # NOT_SERVING until the role's set_serving, after everything it serves is up.
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    register(server)
    if tls is not None and tls.is_server_tls:
        bound_port = server.add_secure_port(f"{host}:{port}", tls.server_credentials())
    else:
        bound_port = server.add_insecure_port(f"{host}:{port}")
    if bound_port == 0:
        raise OSError(f"cannot bind {host}:{port}")
    server.start()
    return GrpcServer(server, health_servicer, bound_port, gate)


def run_until_signalled(
    grpc_server: GrpcServer,
    cleanup: Callable[[], None],
    grace_s: float,
    run_in_main: Callable[[], None] | None = None,
) -> int:
    """Serves until SIGTERM/SIGINT, then shuts down in the documented order.

    run_in_main: work for the main thread meanwhile (an engine loop, which `cleanup` ends); the
    shutdown then runs on a thread of its own, so the engine keeps stepping while calls drain.
    Should that work end on its own, the server shuts down as if signalled."""
    stop = threading.Event()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signal_number, lambda *_: stop.set())
    if run_in_main is None:
        while not stop.wait(0.5):
            pass
        _shut_down(grpc_server, cleanup, grace_s)
        return 0

    def shut_down_when_signalled() -> None:
        while not stop.wait(0.5):
            pass
        _shut_down(grpc_server, cleanup, grace_s)

    shutdown = threading.Thread(target=shut_down_when_signalled, name="shutdown", daemon=True)
    shutdown.start()
    try:
        run_in_main()
    finally:
        stop.set()
        shutdown.join(timeout=grace_s + 30.0)
    return 0


def _shut_down(grpc_server: GrpcServer, cleanup: Callable[[], None], grace_s: float) -> None:
    logger.info("shutting down: draining %d in-flight calls", grpc_server.gate.num_in_flight)
    grpc_server.health.enter_graceful_shutdown()
    if not grpc_server.gate.drain(grace_s):
        grpc_server.gate.abort_in_flight(wait_s=5.0)
    grpc_server.server.stop(grace=1.0).wait(timeout=5.0)
    cleanup()
    logger.info("stopped")


# A channel to a peer that is still starting retries with gRPC's default backoff (1 s growing 1.6x to
# 120 s), so after a 30 s model load it may not look again for another 15 s. Peers retry sooner.
PEER_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def peer_channel(address: str, tls: TlsConfig | None = None) -> grpc.Channel:
    """A channel to another beamsplit process, reconnecting within a second of it listening; TLS
    (showing our certificate, for mutual TLS) when `tls` has a CA."""
    return open_channel(address, tls, options=PEER_CHANNEL_OPTIONS)


def check_health(channel: grpc.Channel, timeout_s: float) -> bool:
    """True when the server answers SERVING within `timeout_s`."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.RpcError:
        return False
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


def wait_until_healthy(
    address: str,
    timeout_s: float,
    is_alive: Callable[[], bool] | None = None,
    tls: TlsConfig | None = None,
) -> bool:
    """Polls the health service of `address` until SERVING, the bound, or `is_alive()` is false."""
    deadline = time.monotonic() + timeout_s
    with peer_channel(address, tls) as channel:
        while time.monotonic() < deadline:
            if is_alive is not None and not is_alive():
                return False
            if check_health(channel, timeout_s=min(1.0, max(0.1, deadline - time.monotonic()))):
                return True
            time.sleep(0.1)
    return False


def announce(role: str, grpc_server: GrpcServer, host: str, metrics_port: int, extra: str = "") -> None:
    """One line on stdout once serving: launchers (the demo, tests) wait for health, people read it."""
    metrics = f", metrics http://{host}:{metrics_port}/metrics" if metrics_port else ""
    print(f"[{role}] serving on {host}:{grpc_server.port}{metrics}{extra}", flush=True)


def configure_logging(role: str) -> None:
    """One line per record: time, role, level, logger, `request_id=` (`-` outside a request), message."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {role} %(levelname)s %(name)s request_id=%(request_id)s: %(message)s",
    )
    for handler in logging.getLogger().handlers:
        if not any(isinstance(existing, RequestIdFilter) for existing in handler.filters):
            handler.addFilter(RequestIdFilter())
