"""Metrics, request-id logs and `beamsplit status` on a real deployment (real processes, real UCX).

One deployment for the module (`tiny`, float64, block 32): context worker, generation worker,
coordinator and aggregated server. Each test reads every process's /metrics before and after
what it does and checks that the series it names moved, and by how much where that is exact.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest

from beamsplit.cli.status import fetch_status
from beamsplit.client.grpc_client import BeamsplitClient, build_request
from beamsplit.launch.launcher import HOST, PortPicker, ServerProcess
from beamsplit.launch.local_cluster import LocalCluster
from beamsplit.server.metrics import read_samples
from beamsplit.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.helpers.clusters import module_cluster

BLOCK = 32
PROMPT_LEN = 67  # two full blocks and a partial tail: beams fork the tail
HISTOGRAMS = (
    "beamsplit_time_to_first_token_seconds",
    "beamsplit_inter_token_latency_seconds",
    "beamsplit_e2e_latency_seconds",
    "beamsplit_prefill_seconds",
    "beamsplit_transfer_seconds",
)
COUNTERS = (
    "beamsplit_requests_total",
    "beamsplit_prefix_prompt_tokens_total",
    "beamsplit_prefix_reused_tokens_total",
    "beamsplit_kv_block_copies_total",
    "beamsplit_transfer_blocks_total",
    "beamsplit_transfer_bytes_total",
    "beamsplit_transfer_failures_total",
    "beamsplit_lease_expiries_total",
)
GAUGES = (
    "beamsplit_requests_in_flight",
    "beamsplit_kv_blocks_capacity",
    "beamsplit_kv_blocks_in_use",
    "beamsplit_kv_blocks_cached",
    "beamsplit_scheduler_waiting_requests",
    "beamsplit_scheduler_running_requests",
    "beamsplit_engine_queued_commands",
    "beamsplit_transfers_in_flight",
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from module_cluster(tmp_path_factory, "service-observability")


def servers(cluster: LocalCluster) -> list[ServerProcess]:
    return [cluster.context, cluster.generation, cluster.coordinator, cluster.aggregated]


def sample(server: ServerProcess, name: str, labels: str = "") -> float:
    return read_samples(server.metrics_text(), name).get(labels, 0.0)


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(PROMPT_LEN)]


def generate(address: str, token_ids: list[int], beam_width: int, request_id: str = "") -> dict[str, object]:
    sampling = common_pb2.SamplingOptions(beam_width=beam_width, max_new_tokens=6)
    request = build_request(token_ids=token_ids, sampling=sampling)
    request.request_id = request_id
    with BeamsplitClient(address) as client:
        return dict(client.generate(request, timeout_s=120.0).stats)


def wait_until(condition: object, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return bool(condition())  # type: ignore[operator]


def test_every_process_exports_every_series(cluster: LocalCluster) -> None:
    for server in servers(cluster):
        text = server.metrics_text()
        for name in GAUGES + COUNTERS:
            assert read_samples(text, name), f"{server.name} lacks {name}"
        for name in HISTOGRAMS:
            for suffix in ("_bucket", "_sum", "_count"):
                assert read_samples(text, name + suffix), f"{server.name} lacks {name}{suffix}"
        assert sample(server, "beamsplit_requests_total", 'outcome="ok"') >= 0
    for server in cluster.engine_servers:
        assert sample(server, "beamsplit_kv_blocks_capacity") > 0


def test_a_request_moves_latency_transfer_and_copy_series(cluster: LocalCluster) -> None:
    names = {
        "ttft": "beamsplit_time_to_first_token_seconds_count",
        "itl": "beamsplit_inter_token_latency_seconds_count",
        "e2e": "beamsplit_e2e_latency_seconds_count",
        "ok": "beamsplit_requests_total",
        "bytes": "beamsplit_transfer_bytes_total",
        "blocks": "beamsplit_transfer_blocks_total",
        "pulls": "beamsplit_transfer_seconds_count",
        "prefills": "beamsplit_prefill_seconds_count",
        "tail": "beamsplit_kv_block_copies_total",
    }

    def read(server: ServerProcess) -> dict[str, float]:
        text = server.metrics_text()
        values = {key: read_samples(text, name).get("", 0.0) for key, name in names.items()}
        values["ok"] = read_samples(text, names["ok"]).get('outcome="ok"', 0.0)
        values["tail"] = read_samples(text, names["tail"]).get('reason="beam_tail"', 0.0)
        return values

    before = {server.name: read(server) for server in servers(cluster)}
    stats = generate(cluster.coordinator.address, prompt(1), beam_width=4)
    generate(cluster.aggregated.address, prompt(1), beam_width=4)
    wait_until(lambda: read(cluster.context)["blocks"] > before["context"]["blocks"])
    after = {server.name: read(server) for server in servers(cluster)}
    moved = {name: {key: after[name][key] - before[name][key] for key in names} for name in after}

    for front in ("coordinator", "aggregated", "generation"):
        assert moved[front]["ttft"] == 1 and moved[front]["e2e"] == 1 and moved[front]["ok"] == 1, moved
        assert moved[front]["itl"] >= 1, moved
    assert moved["context"]["prefills"] == 1
    # A fresh 67-token prompt: 3 pages, pulled once whatever the beam width.
    page_bytes = int(stats["transferred_bytes"]) // 3  # type: ignore[call-overload]
    assert page_bytes > 0
    assert moved["generation"]["blocks"] == 3 and moved["generation"]["bytes"] == 3 * page_bytes
    assert moved["generation"]["pulls"] == 1
    assert moved["context"]["blocks"] == 3 and moved["context"]["bytes"] == 3 * page_bytes
    # 4 beams over a partial tail block: the expansion alone copies the tail 3 times.
    assert moved["generation"]["tail"] >= 3 and moved["aggregated"]["tail"] >= 3, moved
    assert moved["context"]["tail"] == 0  # the context worker never forks beams


def test_a_repeated_prompt_raises_the_hit_counters_on_each_side(cluster: LocalCluster) -> None:
    token_ids = prompt(2)
    sides = {"context": cluster.context, "generation": cluster.generation, "aggregated": cluster.aggregated}

    def read() -> dict[str, tuple[float, float]]:
        return {
            side: (
                sample(server, "beamsplit_prefix_prompt_tokens_total", f'side="{side}"'),
                sample(server, "beamsplit_prefix_reused_tokens_total", f'side="{side}"'),
            )
            for side, server in sides.items()
        }

    generate(cluster.coordinator.address, token_ids, beam_width=2)
    generate(cluster.aggregated.address, token_ids, beam_width=2)
    before = read()
    pages = {server.name: sample(server, "beamsplit_transfer_blocks_total") for server in servers(cluster)}
    generate(cluster.coordinator.address, token_ids, beam_width=2)
    generate(cluster.aggregated.address, token_ids, beam_width=2)
    assert wait_until(lambda: all(read()[side][0] > before[side][0] for side in sides))
    assert wait_until(lambda: sample(cluster.context, "beamsplit_transfer_blocks_total") > pages["context"])
    after = read()
    # Only the block holding the last prompt token crosses the wire, counted once on each side.
    for server in (cluster.context, cluster.generation):
        assert sample(server, "beamsplit_transfer_blocks_total") == pages[server.name] + 1, server.name
    for side in sides:
        looked_up = after[side][0] - before[side][0]
        reused = after[side][1] - before[side][1]
        assert (looked_up, reused) == (PROMPT_LEN, 2 * BLOCK), side
    for server in cluster.engine_servers:
        assert sample(server, "beamsplit_kv_blocks_cached") >= 2, server.name


def test_a_lapsed_lease_counts_an_expiry_and_a_failed_pull(cluster: LocalCluster) -> None:
    expiries = sample(cluster.context, "beamsplit_lease_expiries_total")
    context_failures = sample(cluster.context, "beamsplit_transfer_failures_total", 'reason="lease_lapsed"')
    failures_before = read_samples(cluster.generation.metrics_text(), "beamsplit_transfer_failures_total")
    token_ids = prompt(3)
    with grpc.insecure_channel(cluster.context.address) as channel:
        handoff = (
            worker_pb2_grpc.ContextWorkerStub(channel)
            .Prefill(
                worker_pb2.PrefillRequest(
                    request_id="lapse", prompt_token_ids=token_ids, num_candidates=4, lease_s=0.2
                ),
                timeout=30.0,
            )
            .handoff
        )
    assert sample(cluster.context, "beamsplit_transfers_in_flight") == 1  # held, nobody pulls yet
    assert wait_until(lambda: sample(cluster.context, "beamsplit_lease_expiries_total") == expiries + 1)
    assert sample(cluster.context, "beamsplit_transfers_in_flight") == 0
    assert (
        sample(cluster.context, "beamsplit_transfer_failures_total", 'reason="lease_lapsed"')
        == context_failures + 1
    )
    handoff.context_address = cluster.context.address
    with grpc.insecure_channel(cluster.generation.address) as channel:
        call = worker_pb2_grpc.GenerationWorkerStub(channel).Generate(
            worker_pb2.GenerationRequest(
                handoff=handoff,
                prompt_token_ids=token_ids,
                sampling=common_pb2.SamplingOptions(beam_width=2, max_new_tokens=4),
            ),
            timeout=30.0,
        )
        with pytest.raises(grpc.RpcError) as raised:
            list(call)
    assert raised.value.code() == grpc.StatusCode.ABORTED
    failures_after = read_samples(cluster.generation.metrics_text(), "beamsplit_transfer_failures_total")
    assert sum(failures_after.values()) == sum(failures_before.values()) + 1, failures_after
    assert sample(cluster.generation, "beamsplit_requests_total", 'outcome="aborted"') >= 1


def test_every_log_line_of_a_request_carries_its_id(cluster: LocalCluster) -> None:
    generate(cluster.coordinator.address, prompt(4), beam_width=2, request_id="obs-log-1")
    generate(cluster.aggregated.address, prompt(4), beam_width=2, request_id="obs-log-1")
    expected = {
        "coordinator": "finished",
        "context": "prefilled",
        "generation": "pulled",
        "aggregated": "finished",
    }

    def lines(server: ServerProcess) -> list[str]:
        return [line for line in server.log_path.read_text().splitlines() if "request_id=obs-log-1" in line]

    assert wait_until(lambda: all(lines(server) for server in servers(cluster)))
    for server in servers(cluster):
        found = lines(server)
        assert any(expected[server.name] in line for line in found), (server.name, found)
        text = server.log_path.read_text().splitlines()
        for line in text:
            if "obs-log-1" in line:
                assert "request_id=obs-log-1" in line, (server.name, line)
    # Lines outside any request (here: the coordinator's worker probes) say so.
    assert any("request_id=-: " in line for line in cluster.coordinator.log_path.read_text().splitlines())


def counters(server: ServerProcess) -> dict[str, float]:
    """Every request outcome and transfer counter of one process, flat: 'requests/ok', 'blocks', ..."""
    text = server.metrics_text()
    values = {
        f"requests/{labels.split('=')[1].strip(chr(34))}": value
        for labels, value in read_samples(text, "beamsplit_requests_total").items()
    }
    values |= {
        f"transfer_failures/{labels.split('=')[1].strip(chr(34))}": value
        for labels, value in read_samples(text, "beamsplit_transfer_failures_total").items()
    }
    values["blocks"] = read_samples(text, "beamsplit_transfer_blocks_total").get("", 0.0)
    values["bytes"] = read_samples(text, "beamsplit_transfer_bytes_total").get("", 0.0)
    return values


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        name: after.get(name, 0.0) - before.get(name, 0.0)
        for name in after
        if after.get(name, 0.0) != before.get(name, 0.0)
    }


def test_a_known_mix_moves_every_counter_on_every_process_by_its_share(cluster: LocalCluster) -> None:
    """Two ok requests, one refusal, one cancel, one failed pull (a lapsed lease): each counted
    once, on the process that did the work; 3 pages per 67-token prompt, pulled and served."""
    before = {server.name: counters(server) for server in servers(cluster)}
    status_before = fetch_status(cluster.coordinator.address, 10.0)
    stats = [generate(cluster.coordinator.address, prompt(20 + index), beam_width=2) for index in range(2)]
    assert [int(item["transferred_blocks"]) for item in stats] == [3, 3]  # new prompts: all 3 pages

    with BeamsplitClient(cluster.coordinator.address) as client:  # refused: 400 over HTTP
        sampling = common_pb2.SamplingOptions(beam_width=1, max_new_tokens=100_000)
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(build_request(token_ids=prompt(22), sampling=sampling))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # cancelled after its first delta, when its 3 pages have moved
        sampling = common_pb2.SamplingOptions(beam_width=1, max_new_tokens=2000)
        call = client.stream(build_request(token_ids=prompt(23), sampling=sampling))
        assert next(iter(call)).HasField("delta")
        call.cancel()  # type: ignore[attr-defined]

    token_ids = prompt(24)  # failed: the lease lapses before the generation worker pulls
    with grpc.insecure_channel(cluster.context.address) as channel:
        handoff = (
            worker_pb2_grpc.ContextWorkerStub(channel)
            .Prefill(worker_pb2.PrefillRequest(request_id="mix-lapse", prompt_token_ids=token_ids, num_candidates=2, lease_s=0.2), timeout=30.0)
            .handoff
        )  # fmt: skip
    assert wait_until(
        lambda: (
            counters(cluster.context).get("transfer_failures/lease_lapsed", 0.0)
            > before["context"].get("transfer_failures/lease_lapsed", 0.0)
        )
    )
    handoff.context_address = cluster.context.address
    with grpc.insecure_channel(cluster.generation.address) as channel:
        lapsed = worker_pb2_grpc.GenerationWorkerStub(channel).Generate(
            worker_pb2.GenerationRequest(handoff=handoff, prompt_token_ids=token_ids, sampling=common_pb2.SamplingOptions(beam_width=1, max_new_tokens=2)),
            timeout=30.0,
        )  # fmt: skip
        with pytest.raises(grpc.RpcError):
            list(lapsed)

    page_bytes = (after_context := counters(cluster.context))["bytes"] - before["context"]["bytes"]
    page_bytes /= 9
    expected = {
        "coordinator": {"requests/ok": 2, "requests/invalid_argument": 1, "requests/cancelled": 1},
        "context": {
            "requests/ok": 4,  # two ok, the cancelled one's and the lapsed one's prefills
            "blocks": 9,
            "bytes": 9 * page_bytes,
            "transfer_failures/lease_lapsed": 1,
        },
        "generation": {
            "requests/ok": 2,
            "requests/cancelled": 1,
            "requests/aborted": 1,
            "blocks": 9,
            "bytes": 9 * page_bytes,
        },
        "aggregated": {},
    }

    def observed() -> dict[str, dict[str, float]]:
        return {server.name: moved(before[server.name], counters(server)) for server in servers(cluster)}

    wait_until(lambda: observed()["generation"].keys() >= expected["generation"].keys(), timeout_s=30.0)
    generation_failures = {
        k: v for k, v in observed()["generation"].items() if k.startswith("transfer_failures/")
    }
    assert sum(generation_failures.values()) == 1, generation_failures  # the pull that found no offer
    actual = {
        name: {
            k: v for k, v in moves.items() if not k.startswith("transfer_failures/") or name != "generation"
        }
        for name, moves in observed().items()
    }
    assert actual == expected, f"context bytes moved {after_context['bytes'] - before['context']['bytes']}"
    assert page_bytes > 0 and page_bytes == int(page_bytes)

    time.sleep(1.5)  # one probe period: the coordinator's view of the workers catches up
    status = fetch_status(cluster.coordinator.address, 10.0)
    assert status.requests_ok - status_before.requests_ok == 2
    assert status.requests_refused - status_before.requests_refused == 1
    assert status.requests_cancelled - status_before.requests_cancelled == 1
    assert status.requests_failed == status_before.requests_failed


def run_status(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "beamsplit.cli", "status", *arguments],
        capture_output=True,
        text=True,
        timeout=60.0,
    )


def test_status_summarises_the_deployment(cluster: LocalCluster) -> None:
    generate(cluster.coordinator.address, prompt(5), beam_width=2)
    time.sleep(1.0)  # one probe period: the coordinator's view includes that request
    result = run_status("--target", cluster.coordinator.address)
    assert result.returncode == 0, result.stderr
    print(result.stdout)
    out = result.stdout
    assert out.startswith(f"coordinator {cluster.coordinator.address}:")
    assert "2/2 workers healthy" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(HOST)}
    assert set(rows) == {cluster.context.address, cluster.generation.address}
    assert rows[cluster.context.address].split()[1:3] == ["context", "healthy"]
    assert rows[cluster.generation.address].split()[1:3] == ["generation", "healthy"]
    assert "pages" in rows[cluster.generation.address] and "%" in rows[cluster.generation.address]

    as_json = json.loads(run_status("--target", cluster.coordinator.address, "--json").stdout)
    workers = {worker["address"]: worker for worker in as_json["workers"]}
    context_load = workers[cluster.context.address]["load"]
    assert int(context_load["num_blocks_total"]) == sample(cluster.context, "beamsplit_kv_blocks_capacity")
    assert int(context_load["prompt_tokens"]) > 0 and int(as_json["requests_ok"]) >= 1

    aggregated = run_status("--target", cluster.aggregated.address)
    assert aggregated.returncode == 0, aggregated.stderr
    assert aggregated.stdout.startswith(f"aggregated {cluster.aggregated.address}:")
    assert "1/1 workers healthy" in aggregated.stdout


def test_status_of_a_target_that_is_down_fails_within_its_bound() -> None:
    address = f"{HOST}:{PortPicker().pick()}"
    started = time.monotonic()
    result = run_status("--target", address, "--timeout-s", "1")
    assert result.returncode == 1
    assert result.stderr.startswith(f"beamsplit status: cannot reach {address}: no answer within 1 s")
    assert time.monotonic() - started < 30.0


def test_status_shows_a_stopped_worker_as_down(cluster: LocalCluster) -> None:
    """Last in the module: it stops the generation worker (SIGTERM, a clean exit)."""
    assert cluster.group.stop(cluster.generation) == 0
    assert wait_until(
        lambda: "1/2 workers healthy" in run_status("--target", cluster.coordinator.address).stdout
    )
    result = run_status("--target", cluster.coordinator.address)
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith(cluster.generation.address))
    assert row.split()[1:3] == ["generation", "DOWN"]
    assert f"  {cluster.generation.address}: " in result.stdout.split("unhealthy:")[1]
