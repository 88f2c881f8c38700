"""Endpoints a holder sends on, kept per puller worker so a pull does not pay for UCX wire-up.

A fresh endpoint queues its first send until wire-up completes, which costs both processes progress
rounds on the critical path of every pull; a reused one sends the rendezvous request at once.
The price is that a send cannot be withdrawn alone, so an endpoint that carried a transfer which
did not end DONE is marked dirty and closed (ucxx `close()`: the close is started, not waited for,
and the requests on it are not cancelled) as soon as no transfer uses it. Its abandoned sends can
never match anything: the puller cancelled the receives, and tags are never reused.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from transfer.ucx_binding import UcxBinding

_LINGER_S = 5.0  # closed endpoints stay referenced while UCX finishes closing them

_logger = logging.getLogger(__name__)


@dataclass
class _PooledEndpoint:
    endpoint: Any
    worker_address: bytes
    num_users: int = 0
    is_dirty: bool = False


class EndpointPool:
    """Owned by the agent's loop thread; no locking."""

    def __init__(self, binding: UcxBinding) -> None:
        self._binding = binding
        self._current: dict[bytes, _PooledEndpoint] = {}  # the endpoint new sends to a worker use
        self._in_use: dict[int, _PooledEndpoint] = {}  # by id(endpoint), current or retired
        self._closing: list[tuple[float, Any]] = []

    def acquire(self, worker_address: bytes) -> Any:
        pooled = self._current.get(worker_address)
        if pooled is None or pooled.is_dirty:
            pooled = _PooledEndpoint(self._binding.connect(worker_address), worker_address)
            self._current[worker_address] = pooled
            self._in_use[id(pooled.endpoint)] = pooled
        pooled.num_users += 1
        return pooled.endpoint

    def release(self, endpoint: Any, is_clean: bool) -> None:
        pooled = self._in_use.get(id(endpoint))
        if pooled is None:
            return
        pooled.num_users -= 1
        pooled.is_dirty = pooled.is_dirty or not is_clean
        if pooled.is_dirty and pooled.num_users == 0:
            del self._in_use[id(endpoint)]
            if self._current.get(pooled.worker_address) is pooled:
                del self._current[pooled.worker_address]
            self.close(endpoint)

    def close(self, endpoint: Any) -> None:
        """Starts closing now (without waiting for the peer) and keeps a reference while UCX finishes."""
        try:
            self._binding.close_endpoint(endpoint)
        except Exception:  # the session ends all the same; the endpoint is dropped with the binding
            _logger.exception("closing an endpoint to a puller failed")
        self._closing.append((time.monotonic(), endpoint))

    def sweep(self, now: float) -> None:
        self._closing = [(since, endpoint) for since, endpoint in self._closing if now - since < _LINGER_S]

    def close_all(self) -> None:
        for pooled in self._in_use.values():
            self.close(pooled.endpoint)
        self._in_use.clear()
        self._current.clear()
