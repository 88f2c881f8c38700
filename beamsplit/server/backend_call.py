"""One client API call run for an asyncio caller: the HTTP front's bridge to a blocking backend.

The backend's `generate` is a blocking generator (it waits on the engine loop or on a worker's
stream), so each call runs it on a thread of its own and hands its responses to the event loop
through a queue. The call passes the server's `ShutdownGate` and counts in the server's metrics
exactly as the gRPC servicer does: both run `instrumented_responses`. `cancel` (a client gone) fires the backend's `on_client_gone`
callbacks, which stop upstream work at once, so no KV page stays held.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable

import grpc
from starlette.requests import Request

from beamsplit.server.client_api_servicer import GenerateBackend, instrumented_responses
from beamsplit.server.log_context import request_context
from beamsplit.server.metrics import ServerMetrics
from beamsplit.server.server_common import SHUTDOWN_MESSAGE, ShutdownGate
from beamsplit.v1 import common_pb2, coordinator_pb2
from beamsplit.wire import ServiceError

logger = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25
_END = object()


class BackendCall:
    """One `backend.generate` on a thread of its own; the event loop awaits its responses."""

    def __init__(
        self,
        backend: GenerateBackend,
        request: coordinator_pb2.GenerateRequest,
        gate: ShutdownGate,
        metrics: ServerMetrics,
        role: str,
        slots: threading.BoundedSemaphore,
    ) -> None:
        """`slots` bounds the calls (threads) in flight at once; a call finding none is refused."""
        self._backend = backend
        self._request = request
        self._gate = gate
        self._metrics = metrics
        self._role = role
        self._slots = slots
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._is_cancelled = False
        self._is_done = False
        self._last_poll = time.monotonic()

    def start(self) -> None:
        if not self._slots.acquire(blocking=False):
            self._push(
                ServiceError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self._role}: too many HTTP requests in flight, try again later",
                )
            )
            self._push(_END)
            return
        threading.Thread(target=self._run, name="http-request", daemon=True).start()

    async def next(self, request: Request | None = None) -> common_pb2.GenerateResponse | None:
        """The next response, None at the end; raises the backend's `ServiceError`. With `request`,
        a client disconnect while waiting cancels the call (raises CANCELLED)."""
        while True:
            # Polled on a clock, not only when idle: a request's deltas may arrive every few ms.
            if request is not None and time.monotonic() - self._last_poll >= DISCONNECT_POLL_S:
                self._last_poll = time.monotonic()
                if await request.is_disconnected():
                    self.cancel()
                    raise ServiceError(grpc.StatusCode.CANCELLED, "client disconnected")
            try:
                item = await asyncio.wait_for(self._queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue
            if item is _END:
                return None
            if isinstance(item, ServiceError):
                raise item
            assert isinstance(item, common_pb2.GenerateResponse)
            return item

    def cancel(self) -> None:
        """The client is gone (or the front needs nothing more): stop the backend's work."""
        with self._lock:
            if self._is_cancelled or self._is_done:
                return
            self._is_cancelled = True
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback()

    def _on_client_gone(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)
            is_cancelled = self._is_cancelled
        if is_cancelled:
            callback()

    def _push(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    def _run(self) -> None:
        try:
            if self._gate.enter():
                self._run_entered()
            else:
                self._push(ServiceError(grpc.StatusCode.UNAVAILABLE, f"{self._role}: {SHUTDOWN_MESSAGE}"))
                self._push(_END)
        finally:
            self._slots.release()

    def _run_entered(self) -> None:
        failure: ServiceError | None = None
        if not self._request.request_id:  # named here so that every log line of the request carries it
            self._request.request_id = uuid.uuid4().hex
        try:
            with request_context(self._request.request_id):
                responses = instrumented_responses(
                    self._backend, self._request, lambda: None, self._on_client_gone,
                    self._gate, self._metrics, self._role, lambda: self._is_cancelled,
                )  # fmt: skip
                for response in responses:
                    if response.HasField("final"):
                        with self._lock:
                            self._is_done = True  # answered: a later cancel has nothing to stop
                    self._push(response)
        except ServiceError as error:
            failure = None if self._is_done else error
        finally:
            with self._lock:
                self._is_done = True  # before the consumer hears of the end, so it never cancels after it
            if failure is not None:
                self._push(failure)
            self._push(_END)
