"""Replays a workload against one of our deployments over gRPC (the coordinator or the aggregated
server: both speak the `Coordinator` API) and samples its KV pools while it runs.

Each request is sent at its arrival time on its own thread, as token ids with `ignore_eos`, and
streamed: the time of each delta is one decode step's arrival at the client (a delta carrying k
steps counts as k). The servers send the last step with the final message rather than in a delta,
so the final message counts for the steps its beams hold beyond the streamed ones. A request's clock starts at its scheduled arrival, not when a thread got to
send it, so a slow client cannot hide queueing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

REQUEST_TIMEOUT_S = 900.0
KV_SAMPLE_EVERY_S = 0.2
MAX_CLIENT_THREADS = 64
CLOSE_BOUND_S = 5.0  # an interrupted replay waits this long for the channel to close, then goes on


class InFlight:
    """The streaming calls a replay has open, so that an interrupted replay can cancel each one.

    Closing the channel alone is not enough: gRPC's `Channel.close()` waits for its calls to
    drain, and after an exception raised by a signal handler it was seen to wait for 20 minutes
    (grpc/grpc#19973 describes the same)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: set[Any] = set()
        self._cancelled = False

    def add(self, call: Any) -> None:
        with self._lock:
            if not self._cancelled:
                self._calls.add(call)
                return
        call.cancel()

    def discard(self, call: Any) -> None:
        with self._lock:
            self._calls.discard(call)

    def cancel_all(self) -> None:
        with self._lock:
            self._cancelled = True
            calls, self._calls = list(self._calls), set()
        for call in calls:
            call.cancel()


def close_within(channel: Any, bound_s: float = CLOSE_BOUND_S) -> bool:
    """Closes `channel` on a daemon thread and waits at most `bound_s`; True if it closed."""
    closer = threading.Thread(target=channel.close, name="close-channel", daemon=True)
    closer.start()
    closer.join(bound_s)
    return not closer.is_alive()


def run_request(
    stub: Any,
    spec: Any,
    record_type: type,
    sent_s: float,
    timeout_s: float = REQUEST_TIMEOUT_S,
    tag: str = "bench",
    in_flight: InFlight | None = None,
) -> Any:
    """One streaming request; returns a `RequestRecord` (errors are recorded, never raised)."""
    import grpc

    from beamsplit.client.grpc_client import build_request
    from beamsplit.v1 import common_pb2
    from beamsplit.wire import stats_to_dict

    record = record_type(index=spec.index, beam_width=spec.beam_width, sent_s=sent_s)
    sampling = common_pb2.SamplingOptions(
        beam_width=spec.beam_width, max_new_tokens=spec.max_new_tokens, ignore_eos=True
    )
    request = build_request(
        token_ids=list(spec.prompt_ids), sampling=sampling, request_id=f"{tag}-{spec.index}"
    )
    call = stub.Generate(request, timeout=timeout_s)
    if in_flight is not None:
        in_flight.add(call)
    try:
        for response in call:
            now = time.monotonic()
            if response.HasField("delta"):
                lengths = [len(beam.token_ids) for beam in response.delta.beams]
                if lengths and max(lengths) > 0:
                    record.step_times_s.append(now)
                    record.step_counts.append(max(lengths))
                    record.num_beam_tokens += sum(lengths)
            elif response.HasField("final"):
                record.end_s = now
                record.final_lengths = [len(beam.token_ids) for beam in response.final.beams]
                # The last decode step comes with the final message, not in a delta of its own.
                remaining = max(record.final_lengths, default=0) - sum(record.step_counts)
                if remaining > 0:
                    record.step_times_s.append(now)
                    record.step_counts.append(remaining)
                    record.num_beam_tokens += remaining * len(record.final_lengths)
                record.finish_reasons = [beam.finish_reason for beam in response.final.beams]
                record.server_stats = stats_to_dict(response.final.stats)
        if record.end_s is None:
            record.error = "stream ended without a final message"
    except grpc.RpcError as error:
        record.error = f"{error.code().name}: {error.details()}"
    finally:
        if in_flight is not None:
            in_flight.discard(call)
    return record


def replay(
    address: str,
    specs: Sequence[Any],
    record_type: type,
    on_done: Callable[[], None],
    tag: str,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> list[Any]:
    """Sends every spec at `start + spec.arrival_s`; returns the records in spec order."""
    import grpc

    from beamsplit.v1 import coordinator_pb2_grpc

    channel = grpc.insecure_channel(address)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    records: list[Any] = [None] * len(specs)
    in_flight = InFlight()

    def send(position: int, spec: Any, sent_s: float) -> None:
        try:
            records[position] = run_request(stub, spec, record_type, sent_s, timeout_s, tag, in_flight)
        except Exception as error:  # e.g. the channel closed under it: recorded, never lost
            records[position] = record_type(spec.index, spec.beam_width, sent_s, error=f"client: {error!r}")
        on_done()

    pool = ThreadPoolExecutor(max_workers=min(MAX_CLIENT_THREADS, len(specs)))
    try:
        start = time.monotonic()
        for position, spec in enumerate(specs):
            scheduled = start + spec.arrival_s
            time.sleep(max(0.0, scheduled - time.monotonic()))
            pool.submit(send, position, spec, scheduled)
        pool.shutdown(wait=True)
    except BaseException:
        # Ctrl-C, SIGTERM or an error: every stream is cancelled now, so no thread waits out its
        # deadline before the servers are stopped, and the close is bounded (see InFlight).
        in_flight.cancel_all()
        close_within(channel)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    close_within(channel)
    return records


def run_alone(
    address: str, spec: Any, record_type: type, tag: str, timeout_s: float = REQUEST_TIMEOUT_S
) -> Any:
    """One request with nothing else in flight."""
    import grpc

    from beamsplit.v1 import coordinator_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        return run_request(stub, spec, record_type, time.monotonic(), timeout_s, tag)


class KvSampler:
    """Polls `beamsplit_kv_blocks_in_use` of some servers every KV_SAMPLE_EVERY_S in a thread.

    The peak is the largest sample, so it can miss a spike shorter than the period; the sum is
    taken per sampling round (the servers are read one after the other, milliseconds apart).
    """

    def __init__(self, servers: Sequence[Any]) -> None:
        self._servers = list(servers)
        self.peak_by_server: dict[str, int] = {server.name: 0 for server in self._servers}
        self.peak_total = 0
        self.num_samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-sampler", daemon=True)

    def __enter__(self) -> KvSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for server in self._servers:
                try:
                    value = int(server.metric("beamsplit_kv_blocks_in_use", timeout_s=2.0) or 0)
                except OSError:
                    continue
                self.peak_by_server[server.name] = max(self.peak_by_server[server.name], value)
                total += value
            self.peak_total = max(self.peak_total, total)
            self.num_samples += 1
            self._stop.wait(KV_SAMPLE_EVERY_S)
