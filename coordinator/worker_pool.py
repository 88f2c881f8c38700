"""The workers of one kind the coordinator may route to, with their health and load.

A probe thread asks every worker for its health (and, when healthy, its load) on a timer. Routing
picks among the workers whose last probe said SERVING and whose layout agrees with the fleet's:
the one whose prefix tree probably holds most of the prompt, within a load slack, else the least
loaded (coordinator/prefix_routing.py). A worker that fails a call is marked unhealthy at once and
stays out of routing until a probe finds it serving again; what we believed its tree held is
forgotten then (it may have restarted empty).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from beamsplit.server.server_common import check_health, peer_channel
from beamsplit.server.tls import TlsConfig
from beamsplit.v1 import common_pb2, coordinator_pb2
from coordinator.prefix_routing import Candidate, PrefixIndex, PromptKeys, rank

logger = logging.getLogger(__name__)


@dataclass
class WorkerHandle:
    address: str
    channel: grpc.Channel
    stub: Any  # ContextWorkerStub or GenerationWorkerStub
    is_healthy: bool = False
    info: common_pb2.WorkerInfo | None = None
    reported_requests: int = 0
    last_load: common_pb2.WorkerLoad | None = None  # the last probe's answer, for status
    last_failure: str = ""  # why the last probe (or call) found it unhealthy
    num_in_flight: int = 0  # requests this coordinator has routed here and not finished
    mismatch: str | None = None  # why this worker's layout cannot serve with the fleet
    prefix_index: PrefixIndex = field(default_factory=PrefixIndex)  # what its tree probably holds

    @property
    def load(self) -> int:
        return max(self.reported_requests, self.num_in_flight)


@dataclass
class WorkerPool:
    kind: str  # "context" | "generation"
    addresses: list[str]
    stub_factory: Callable[[grpc.Channel], Any]
    probe_interval_s: float = 0.5
    probe_timeout_s: float = 1.0
    tls: TlsConfig | None = None  # a CA: TLS to the workers (our certificate shown, for mutual TLS)
    affinity_slack: int = 2  # prefix affinity counts within this many requests of the least load
    workers: list[WorkerHandle] = field(init=False)

    def __post_init__(self) -> None:
        self.workers = []
        for address in self.addresses:
            channel = peer_channel(address, self.tls)
            self.workers.append(WorkerHandle(address, channel, self.stub_factory(channel)))
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._probe_forever, name=f"probe-{self.kind}", daemon=True)
        self._expected_info: common_pb2.WorkerInfo | None = None

    def start(self) -> None:
        self.probe_all()
        self._thread.start()

    def wait_for_info(self, timeout_s: float) -> common_pb2.WorkerInfo | None:
        """Blocks until one worker has described itself (or the bound passes)."""
        with self._changed:
            self._changed.wait_for(lambda: any(worker.info is not None for worker in self.workers), timeout_s)
            for worker in self.workers:
                if worker.info is not None:
                    return worker.info
        return None

    def set_expected_info(self, info: common_pb2.WorkerInfo) -> None:
        with self._lock:
            self._expected_info = info
            for worker in self.workers:
                worker.mismatch = _layout_mismatch(info, worker.info)
                if worker.info is not None and worker.mismatch is not None:
                    logger.error(
                        "%s worker %s is left out of routing: %s", self.kind, worker.address, worker.mismatch
                    )

    def pick(self, exclude: set[str] | None = None, keys: PromptKeys | None = None) -> WorkerHandle | None:
        """The healthy worker not in `exclude` (addresses) that `rank` prefers for a prompt with
        `keys` (None: the least loaded), counted as in flight until `finish`; None if none."""
        excluded = exclude or set()
        lookup = keys.lookup if keys is not None else ()
        with self._lock:
            routable = [
                (index, worker)
                for index, worker in enumerate(self.workers)
                if worker.is_healthy and worker.mismatch is None and worker.address not in excluded
            ]
            if not routable:
                return None
            candidates = [
                Candidate(index, worker.load, worker.num_in_flight, worker.prefix_index.match(lookup))
                for index, worker in routable
            ]
            chosen = self.workers[rank(candidates, self.affinity_slack).index]
            chosen.num_in_flight += 1
            return chosen

    def remember(self, worker: WorkerHandle, keys: PromptKeys) -> None:
        """`worker` took the prompt: its tree now holds the prompt's full blocks."""
        with self._lock:
            worker.prefix_index.insert(keys.recorded)

    def check_integrity(self) -> None:
        with self._lock:
            for worker in self.workers:
                assert worker.num_in_flight >= 0, f"{worker.address}: negative in-flight count"
                worker.prefix_index.check_integrity()

    def finish(self, worker: WorkerHandle) -> None:
        with self._lock:
            worker.num_in_flight -= 1

    def mark_unhealthy(self, worker: WorkerHandle, reason: str) -> None:
        with self._lock:
            if worker.is_healthy:
                logger.warning("%s worker %s marked unhealthy: %s", self.kind, worker.address, reason)
            worker.is_healthy = False
            worker.last_failure = reason
            worker.prefix_index.clear()

    def num_healthy(self) -> int:
        with self._lock:
            return sum(1 for worker in self.workers if worker.is_healthy and worker.mismatch is None)

    def statuses(self) -> list[coordinator_pb2.WorkerStatus]:
        """Each worker as its last probe saw it (`beamsplit status`)."""
        with self._lock:
            statuses = []
            for worker in self.workers:
                status = coordinator_pb2.WorkerStatus(
                    address=worker.address,
                    role=self.kind,
                    healthy=worker.is_healthy and worker.mismatch is None,
                    detail=worker.mismatch or ("" if worker.is_healthy else worker.last_failure),
                )
                if worker.info is not None:
                    status.info.CopyFrom(worker.info)
                if worker.last_load is not None:
                    status.load.CopyFrom(worker.last_load)
                statuses.append(status)
            return statuses

    def close(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        for worker in self.workers:
            worker.channel.close()

    def probe_all(self) -> None:
        for worker in self.workers:
            self._probe(worker)

    def _probe_forever(self) -> None:
        while not self._stopping.wait(self.probe_interval_s):
            self.probe_all()

    def _probe(self, worker: WorkerHandle) -> None:
        is_healthy = check_health(worker.channel, self.probe_timeout_s)
        info = worker.info
        reported_requests = worker.reported_requests
        load = worker.last_load
        failure = "" if is_healthy else "health check did not answer SERVING"
        if is_healthy:
            try:
                if info is None:
                    info = worker.stub.GetInfo(common_pb2.WorkerInfoRequest(), timeout=self.probe_timeout_s)
                load = worker.stub.GetLoad(common_pb2.LoadRequest(), timeout=self.probe_timeout_s)
                reported_requests = load.num_requests
            except grpc.RpcError as error:
                is_healthy = False
                failure = f"probe failed: {error.code().name}"
        with self._changed:
            if is_healthy != worker.is_healthy:
                logger.info(
                    "%s worker %s is %s", self.kind, worker.address, "healthy" if is_healthy else "unhealthy"
                )
            if not is_healthy:
                worker.prefix_index.clear()  # it may come back restarted, its tree empty
            elif info is not None and info.num_blocks > 0 and worker.prefix_index.capacity != info.num_blocks:
                worker.prefix_index.resize(info.num_blocks)  # its tree holds no more blocks than that
            worker.is_healthy = is_healthy
            worker.last_failure = failure
            worker.last_load = load
            worker.info = info
            worker.reported_requests = reported_requests
            if self._expected_info is not None:
                mismatch = _layout_mismatch(self._expected_info, info)
                if mismatch is not None and mismatch != worker.mismatch and info is not None:
                    logger.error(
                        "%s worker %s is left out of routing: %s", self.kind, worker.address, mismatch
                    )
                worker.mismatch = mismatch
            self._changed.notify_all()


def _layout_mismatch(expected: common_pb2.WorkerInfo, info: common_pb2.WorkerInfo | None) -> str | None:
    if info is None:
        return "not described yet"
    for name in ("model", "dtype", "tokens_per_block", "page_bytes", "vocab_size"):
        if getattr(info, name) != getattr(expected, name):
            return f"{name} {getattr(info, name)!r} differs from the fleet's {getattr(expected, name)!r}"
    return None
