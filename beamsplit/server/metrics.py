"""Prometheus metrics of one server process, in a registry of its own (no module globals).

`beamsplit_kv_blocks_in_use` counts blocks referenced by live requests or pinned for a transfer;
cached blocks that nothing references are free to evict and do not count. Tests read it through
`/metrics` to prove that every fault returns the pool to its baseline.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class ServerMetrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        self.role = role
        self.kv_blocks_in_use = Gauge(
            "beamsplit_kv_blocks_in_use",
            "KV blocks held by live requests or pinned for a transfer (unreferenced cached blocks excluded)",
            registry=self.registry,
        )
        self.kv_blocks_total = Gauge(
            "beamsplit_kv_blocks_total", "KV pool size in blocks", registry=self.registry
        )
        self.requests_in_flight = Gauge(
            "beamsplit_requests_in_flight", "requests this server is working on", registry=self.registry
        )
        self.requests = Counter(
            "beamsplit_requests", "requests by outcome", ["outcome"], registry=self.registry
        )
        self.transferred_blocks = Counter(
            "beamsplit_transferred_blocks",
            "KV pages pulled (generation) or served (context)",
            registry=self.registry,
        )
        self.transferred_bytes = Counter(
            "beamsplit_transferred_bytes", "KV bytes pulled or served", registry=self.registry
        )
        self.last_blocks_in_use = 0  # an int read by GetLoad without touching the engine
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def observe_engine(self, engine: Any) -> None:
        """Called on the engine thread after every loop iteration."""
        self.last_blocks_in_use = int(engine.num_blocks_in_use())
        self.kv_blocks_in_use.set(self.last_blocks_in_use)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Starts the /metrics HTTP endpoint (port 0: no endpoint)."""
        if port:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def read_gauge(metrics_text: str, name: str) -> float | None:
    """The value of an unlabelled sample in a /metrics page, for tests and the demo."""
    for line in metrics_text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{}"):
            return float(line.split()[-1])
    return None
