"""200 concurrent streaming requests at a 1+1 deployment (one context worker, one generation
worker, a coordinator; `tiny`): mixed beam widths 1/2/4, prompt lengths 8-200 tokens, half of them
sharing one of four 64-token prefixes, 8 new tokens each. Within a bound every request completes
or is refused with RESOURCE_EXHAUSTED; none is lost or answered twice; afterwards both pools
are back to zero blocks in use.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from beamsplit.client.load_driver import mixed_specs, run_concurrently
from beamsplit.launch.launcher import ProcessGroup, ServerProcess

NUM_REQUESTS = 200
REQUEST_TIMEOUT_S = 240.0  # the bound on each stream; the whole run is bounded by it too
ENGINE = ["--model", "tiny", "--dtype", "float32", "--tokens-per-block", "32"]


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, list[ServerProcess]]]:
    log_dir: Path = tmp_path_factory.mktemp("service-load")
    group = ProcessGroup(log_dir)
    try:
        context = group.start("context", "context", ENGINE)
        generation = group.start("generation", "generation", ENGINE)
        coordinator = group.start(
            "coordinator", "coordinator", ["--context", context.address, "--generation", generation.address]
        )
        for server in (context, generation, coordinator):
            group.wait_healthy(server, 180.0)
        yield coordinator, [context, generation]
    finally:
        codes = group.stop_all()
    assert all(code == 0 for code in codes.values()), f"unclean exits {codes}; logs in {log_dir}"


def test_200_concurrent_streams(deployment: tuple[ServerProcess, list[ServerProcess]]) -> None:
    coordinator, workers = deployment
    specs = mixed_specs(NUM_REQUESTS, seed=11)
    started = time.monotonic()
    outcomes = run_concurrently(coordinator.address, specs, timeout_s=REQUEST_TIMEOUT_S)
    elapsed = time.monotonic() - started
    counts = collections.Counter(outcome.outcome for outcome in outcomes)
    seconds = sorted(outcome.seconds for outcome in outcomes)
    summary = {
        "requests": len(outcomes), "outcomes": dict(counts), "wall_s": round(elapsed, 1),
        "p50_s": round(seconds[len(seconds) // 2], 2), "max_s": round(seconds[-1], 2),
    }  # fmt: skip
    print(json.dumps(summary))  # the figures docs/robustness.md quotes (pytest -s)

    assert len(outcomes) == NUM_REQUESTS
    assert len({outcome.request_id for outcome in outcomes}) == NUM_REQUESTS, "a request answered twice"
    unexpected = [outcome for outcome in outcomes if outcome.outcome not in ("ok", "RESOURCE_EXHAUSTED")]
    assert not unexpected, unexpected[:5]
    for outcome, spec in zip(outcomes, specs, strict=True):
        if outcome.outcome == "ok":
            assert outcome.num_finals == 1 and outcome.num_beams == spec.beam_width, outcome
        else:
            assert outcome.detail, "a refusal without a message"
    assert counts["ok"] >= NUM_REQUESTS // 2, f"most requests should be served: {counts}"

    deadline = time.monotonic() + 15.0
    blocks = {server.name: server.metric("beamsplit_kv_blocks_in_use") for server in workers}
    while any(blocks.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        blocks = {server.name: server.metric("beamsplit_kv_blocks_in_use") for server in workers}
    assert all(value == 0 for value in blocks.values()), f"KV blocks still in use: {blocks}"
    assert coordinator.metric("beamsplit_requests_in_flight") == 0
