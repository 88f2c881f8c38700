"""Prometheus metrics of one server process, in a registry of its own (no module globals).

Every process (coordinator, context worker, generation worker, aggregated server) registers the
same series, so one dashboard reads them all; a series a role never moves stays at 0. The engine
never sees this module: the engine thread hands `observe_engine` a plain `EngineCounters`
snapshot after every loop iteration, and lifetime counters move by the snapshot's difference.

`beamsplit_kv_blocks_in_use` counts blocks referenced by live requests or pinned for a transfer;
cached blocks that nothing references are free to evict and do not count. Tests read it through
`/metrics` to prove that every fault returns the pool to its baseline. docs/observability.md
lists every series.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Seconds: a tiny model on CPU answers in milliseconds, a real one on a GPU within minutes.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OUTCOMES = ("ok", "invalid_argument", "resource_exhausted", "unavailable", "cancelled", "error")
COPY_REASONS = ("beam_tail", "partial_reuse")
TRANSFER_FAILURE_REASONS = ("failed", "timed_out", "cancelled", "lease_lapsed", "dropped")


@dataclass
class MetricsSnapshot:
    """Plain numbers a worker reports in `GetLoad` (and `beamsplit status` prints)."""

    num_blocks_total: int = 0
    num_blocks_in_use: int = 0
    num_blocks_cached: int = 0
    num_waiting_requests: int = 0
    num_queued_requests: int = 0  # a worker's admission queue (context and generation workers)
    prompt_tokens: int = 0
    reused_tokens: int = 0
    beam_tail_copies: int = 0
    transfer_blocks: int = 0
    transfer_bytes: int = 0
    transfer_failures: int = 0
    transfers_in_flight: int = 0
    lease_expiries: int = 0
    requests: dict[str, int] = field(default_factory=dict)
    # Per KV group: (name, blocks in use, blocks total)
    kv_groups: list[tuple[str, int, int]] = field(default_factory=list)


class ServerMetrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        self.role = role
        self._lock = threading.Lock()
        self._snapshot = MetricsSnapshot()
        self._last_engine: Any = None
        registry = self.registry
        # -- requests ------------------------------------------------------------------------
        self.requests_in_flight = Gauge(
            "beamsplit_requests_in_flight", "requests this server is working on", registry=registry
        )
        self.requests = Counter(
            "beamsplit_requests", "finished requests by outcome (ok or the status code)", ["outcome"],
            registry=registry,
        )  # fmt: skip
        self.time_to_first_token = Histogram(
            "beamsplit_time_to_first_token_seconds",
            "request arrival to its first streamed tokens",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "beamsplit_inter_token_latency_seconds",
            "time between two streamed deltas of one request (one token per beam each)",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.e2e_latency = Histogram(
            "beamsplit_e2e_latency_seconds",
            "request arrival to its final result",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.prefill_latency = Histogram(
            "beamsplit_prefill_seconds",
            "context worker: one Prefill, engine queue included",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        # -- engine: pool, queue, prefix reuse, copies ---------------------------------------
        self.kv_blocks_in_use = Gauge(
            "beamsplit_kv_blocks_in_use",
            "KV blocks held by live requests or pinned for a transfer (unreferenced cached blocks excluded)",
            registry=registry,
        )
        self.kv_blocks_total = Gauge(
            "beamsplit_kv_blocks_capacity", "KV pool size in blocks", registry=registry
        )
        self.kv_blocks_cached = Gauge(
            "beamsplit_kv_blocks_cached",
            "unreferenced KV blocks kept in the prefix tree (evictable)",
            registry=registry,
        )
        self.waiting_requests = Gauge(
            "beamsplit_scheduler_waiting_requests",
            "requests queued in the engine's scheduler, not yet admitted to the batch",
            registry=registry,
        )
        self.queued_requests = Gauge(
            "beamsplit_admission_queued_requests",
            "requests waiting in the worker's admission queue for KV blocks (context and generation "
            "workers; the aggregated server's queue is beamsplit_scheduler_waiting_requests)",
            registry=registry,
        )
        self.running_requests = Gauge(
            "beamsplit_scheduler_running_requests", "requests in the engine's batch", registry=registry
        )
        self.engine_commands = Gauge(
            "beamsplit_engine_queued_commands",
            "calls waiting for the engine thread (prefill, reserve, add, abort), read at scrape time",
            registry=registry,
        )
        self.core_turns_skipped = Gauge(
            "beamsplit_core_turns_skipped",
            "engine steps run without a turn on cores shared with another engine process (--shares-cores): "
            "the other held them past the bound (stopped or slow); 0 without --shares-cores",
            registry=registry,
        )
        self.prefix_prompt_tokens = Counter(
            "beamsplit_prefix_prompt_tokens",
            "prompt tokens looked up in the prefix tree, by side (the process role)",
            ["side"],
            registry=registry,
        )
        self.prefix_reused_tokens = Counter(
            "beamsplit_prefix_reused_tokens",
            "prompt tokens found in the prefix tree (not computed or pulled again), by side",
            ["side"],
            registry=registry,
        )
        self.prefix_window_pruned_tokens = Counter(
            "beamsplit_prefix_window_pruned_tokens",
            "prompt tokens the full-attention layers' pages held but a sliding-window layer's pages "
            "did not (reuse cut to what every KV group can continue from), by side",
            ["side"],
            registry=registry,
        )
        self.kv_group_blocks_total = Gauge(
            "beamsplit_kv_group_blocks_total",
            "KV pool blocks every attention kind (full, or window<W>) may use: the one shared pool's total",
            ["group"],
            registry=registry,
        )
        self.kv_group_blocks_in_use = Gauge(
            "beamsplit_kv_group_blocks_in_use",
            "KV blocks in use per attention kind (full, or window<W>: summed over its KV groups)",
            ["group"],
            registry=registry,
        )
        self.prefix_hybrid_pruned_tokens = Counter(
            "beamsplit_prefix_hybrid_pruned_tokens",
            "prompt tokens the prefix tree's pages held but no recurrent-state snapshot reached "
            "(hybrid models: reuse cut to the last snapshot), by side",
            ["side"],
            registry=registry,
        )
        self.block_copies = Counter(
            "beamsplit_kv_block_copies",
            "KV blocks copied: beam_tail (a forked beam's partial last block), partial_reuse (copy-on-write)",
            ["reason"],
            registry=registry,
        )
        # -- transfer ------------------------------------------------------------------------
        self.transfer_blocks = Counter(
            "beamsplit_transfer_blocks", "KV pages pulled (generation) or served (context)", registry=registry
        )
        self.transfer_bytes = Counter(
            "beamsplit_transfer_bytes", "KV bytes pulled (generation) or served (context)", registry=registry
        )
        self.transfer_seconds = Histogram(
            "beamsplit_transfer_seconds",
            "generation worker: one pull, start to last page",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.transfer_failures = Counter(
            "beamsplit_transfer_failures", "pulls (or offers) that ended without the pages", ["reason"],
            registry=registry,
        )  # fmt: skip
        self.transfers_in_flight = Gauge(
            "beamsplit_transfers_in_flight",
            "generation: pulls running; context: prompts held for a pull",
            registry=registry,
        )
        self.lease_expiries = Counter(
            "beamsplit_lease_expiries", "context worker: holds ended because their lease lapsed", registry=registry
        )  # fmt: skip
        # Every labelled series exists from the start, at 0, so dashboards and tests find it.
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)
        self.prefix_prompt_tokens.labels(side=role)
        self.prefix_reused_tokens.labels(side=role)
        self.prefix_hybrid_pruned_tokens.labels(side=role)
        self.prefix_window_pruned_tokens.labels(side=role)
        for reason in COPY_REASONS:
            self.block_copies.labels(reason=reason)
        for reason in TRANSFER_FAILURE_REASONS:
            self.transfer_failures.labels(reason=reason)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def last_blocks_in_use(self) -> int:
        """Read by GetLoad without touching the engine."""
        return self._snapshot.num_blocks_in_use

    # -- engine ------------------------------------------------------------------------------
    def observe_engine(self, engine: Any) -> None:
        """Called on the engine thread after every loop iteration."""
        self.observe_counters(engine.counters())

    def observe_counters(self, counters: Any) -> None:
        """`counters`: an `engine.types.EngineCounters` (duck-typed: this module imports no engine)."""
        previous = self._last_engine
        self._last_engine = counters
        self.kv_blocks_total.set(counters.num_blocks_total)
        self.kv_blocks_in_use.set(counters.num_blocks_in_use)
        self.kv_blocks_cached.set(counters.num_blocks_cached)
        self.waiting_requests.set(counters.num_waiting_requests)
        self.running_requests.set(counters.num_running_requests)

        def grown(name: str) -> int:
            before = 0 if previous is None else getattr(previous, name)
            return max(0, getattr(counters, name) - before)

        self.prefix_prompt_tokens.labels(side=self.role).inc(grown("prompt_tokens"))
        self.prefix_reused_tokens.labels(side=self.role).inc(grown("reused_tokens"))
        self.prefix_hybrid_pruned_tokens.labels(side=self.role).inc(grown("hybrid_pruned_tokens"))
        if hasattr(counters, "window_pruned_tokens"):
            self.prefix_window_pruned_tokens.labels(side=self.role).inc(grown("window_pruned_tokens"))
        groups = (
            getattr(counters, name, ())
            for name in ("group_names", "group_blocks_total", "group_blocks_in_use")
        )
        kv_groups = []
        for name, total, in_use in zip(*groups, strict=True):
            self.kv_group_blocks_total.labels(group=name).set(total)
            self.kv_group_blocks_in_use.labels(group=name).set(in_use)
            kv_groups.append((name, in_use, total))
        self.block_copies.labels(reason="beam_tail").inc(grown("beam_tail_copies"))
        self.block_copies.labels(reason="partial_reuse").inc(grown("partial_reuse_copies"))
        with self._lock:
            snapshot = self._snapshot
            snapshot.num_blocks_total = counters.num_blocks_total
            snapshot.num_blocks_in_use = counters.num_blocks_in_use
            snapshot.num_blocks_cached = counters.num_blocks_cached
            snapshot.num_waiting_requests = counters.num_waiting_requests
            snapshot.prompt_tokens = counters.prompt_tokens
            snapshot.reused_tokens = counters.reused_tokens
            snapshot.beam_tail_copies = counters.beam_tail_copies
            snapshot.kv_groups = kv_groups

    def set_queued_requests(self, count: int) -> None:
        self.queued_requests.set(count)
        with self._lock:
            self._snapshot.num_queued_requests = count

    # -- requests ----------------------------------------------------------------------------
    def count_request(self, outcome: str) -> None:
        self.requests.labels(outcome=outcome).inc()
        with self._lock:
            self._snapshot.requests[outcome] = self._snapshot.requests.get(outcome, 0) + 1

    # -- transfer ----------------------------------------------------------------------------
    def record_transfer(self, num_blocks: int, num_bytes: int, seconds: float | None = None) -> None:
        self.transfer_blocks.inc(num_blocks)
        self.transfer_bytes.inc(num_bytes)
        if seconds is not None:
            self.transfer_seconds.observe(seconds)
        with self._lock:
            self._snapshot.transfer_blocks += num_blocks
            self._snapshot.transfer_bytes += num_bytes

    def record_transfer_failure(self, reason: str) -> None:
        self.transfer_failures.labels(reason=reason).inc()
        with self._lock:
            self._snapshot.transfer_failures += 1

    def set_transfers_in_flight(self, count: int) -> None:
        self.transfers_in_flight.set(count)
        with self._lock:
            self._snapshot.transfers_in_flight = count

    def change_transfers_in_flight(self, delta: int) -> None:
        with self._lock:
            self._snapshot.transfers_in_flight += delta
            self.transfers_in_flight.set(self._snapshot.transfers_in_flight)

    def record_lease_expiry(self) -> None:
        self.lease_expiries.inc()
        with self._lock:
            self._snapshot.lease_expiries += 1

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            snapshot = self._snapshot
            return MetricsSnapshot(**{**vars(snapshot), "requests": dict(snapshot.requests)})

    # -- endpoint ----------------------------------------------------------------------------
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


def read_samples(metrics_text: str, name: str) -> dict[str, float]:
    """Every sample of `name` (labels text -> value): `{'': 3.0}` unlabelled, `{'outcome="ok"': 1.0}`."""
    samples: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        if line.startswith(name + " "):
            samples[""] = float(line.split()[-1])
        elif line.startswith(name + "{"):
            labels, _, value = line[len(name) + 1 :].rpartition("} ")
            samples[labels] = float(value)
    return samples


class RequestTimer:
    """Latency of one streamed request: TTFT at the first delta, inter-token latency between
    deltas, end to end at the final result. Made when the request arrives."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self.arrived = time.perf_counter()
        self._last_delta: float | None = None

    def on_delta(self) -> None:
        now = time.perf_counter()
        if self._last_delta is None:
            self._metrics.time_to_first_token.observe(now - self.arrived)
        else:
            self._metrics.inter_token_latency.observe(now - self._last_delta)
        self._last_delta = now

    def on_final(self) -> float:
        """Observes and returns the end-to-end seconds."""
        seconds = time.perf_counter() - self.arrived
        self._metrics.e2e_latency.observe(seconds)
        return seconds
