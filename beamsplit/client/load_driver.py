"""Many concurrent streaming requests at one client-API server, each accounted for exactly once.

Used by the load test and the soak benchmark. Every request gets its own id, runs on its own
thread with a deadline, and ends as one `StreamOutcome`: `ok` (exactly one final message, last),
a gRPC status name, or `lost` (the stream ended with neither a final message nor an error, or
sent more than one final, or the thread missed its bound). A request is never counted twice.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import grpc

from beamsplit.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

NUM_TOKEN_IDS = 256  # the tiny model's byte ids; every model has at least these


@dataclass(frozen=True)
class RequestSpec:
    prompt_ids: tuple[int, ...]
    beam_width: int
    max_new_tokens: int


@dataclass(frozen=True)
class StreamOutcome:
    request_id: str
    outcome: str  # "ok", a grpc.StatusCode name, or "lost"
    num_finals: int
    num_beams: int
    detail: str
    seconds: float


def mixed_specs(
    num_requests: int,
    seed: int,
    beam_widths: Sequence[int] = (1, 2, 4),
    prompt_lens: Sequence[int] = (8, 40, 100, 200),
    max_new_tokens: int = 8,
    num_shared_prefixes: int = 4,
) -> list[RequestSpec]:
    """Mixed widths and lengths; half the prompts start with one of a few shared 64-token prefixes."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(NUM_TOKEN_IDS) for _ in range(64)) for _ in range(num_shared_prefixes)]
    specs = []
    for index in range(num_requests):
        length = rng.choice(prompt_lens)
        tail = tuple(rng.randrange(NUM_TOKEN_IDS) for _ in range(length))
        prompt = (rng.choice(prefixes) + tail)[:length] if index % 2 and length > 64 else tail
        specs.append(RequestSpec(prompt, rng.choice(beam_widths), max_new_tokens))
    return specs


def run_stream(
    stub: coordinator_pb2_grpc.CoordinatorStub, spec: RequestSpec, timeout_s: float
) -> StreamOutcome:
    request_id = f"load-{uuid.uuid4().hex[:12]}"
    request = coordinator_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=common_pb2.TokenIds(token_ids=spec.prompt_ids),
        sampling=common_pb2.SamplingOptions(beam_width=spec.beam_width, max_new_tokens=spec.max_new_tokens),
    )
    started = time.monotonic()
    num_finals = num_beams = 0
    last_is_final = False
    try:
        for response in stub.Generate(request, timeout=timeout_s):
            last_is_final = response.HasField("final")
            if last_is_final:
                num_finals += 1
                num_beams = len(response.final.beams)
    except grpc.RpcError as error:
        code = error.code()
        outcome = code.name if num_finals == 0 else "lost"  # an error after a final: accounted twice
        return StreamOutcome(
            request_id, outcome, num_finals, 0, error.details() or "", time.monotonic() - started
        )
    outcome = "ok" if num_finals == 1 and last_is_final else "lost"
    detail = "" if outcome == "ok" else f"stream ended with {num_finals} final messages"
    return StreamOutcome(request_id, outcome, num_finals, num_beams, detail, time.monotonic() - started)


def run_concurrently(
    address: str, specs: Sequence[RequestSpec], timeout_s: float, max_concurrency: int | None = None
) -> list[StreamOutcome]:
    """All of `specs` at once (or `max_concurrency` at a time) on one channel; one outcome each.

    Returns within `timeout_s` plus a few seconds: a stream still open past its deadline (which
    gRPC should have ended) is reported `lost`.
    """
    outcomes: list[StreamOutcome | None] = [None] * len(specs)
    # All at once means at once: every thread waits for the others before it sends.
    barrier = threading.Barrier(len(specs), timeout=30.0) if max_concurrency is None and specs else None

    def one(index: int) -> None:
        if barrier is not None:
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                pass  # a slow thread: start anyway
        outcomes[index] = run_stream(stub, specs[index], timeout_s)

    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        with ThreadPoolExecutor(max_workers=max_concurrency or len(specs) or 1) as pool:
            futures = [pool.submit(one, index) for index in range(len(specs))]
            wait(futures, timeout=timeout_s * (1 + len(specs) // (max_concurrency or len(specs) or 1)) + 30.0)
    return [
        outcome
        if outcome is not None
        else StreamOutcome("?", "lost", 0, 0, "no outcome within the bound", timeout_s)
        for outcome in outcomes
    ]
