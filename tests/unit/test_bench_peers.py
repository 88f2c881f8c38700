"""`beamsplit bench peers`: its pure rules exactly, and its --quick run end to end (beamsplit's two
deployments and transformers on a tiny random Llama; the peers without their venv skipped with why)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from beamsplit.cli import bench

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rules() -> Any:
    bench.load_bench_module("peers")  # registers its siblings
    return sys.modules["bench_peers_report"]


def test_cpu_flags_and_precisions(rules: Any) -> None:
    amx = "processor : 0\nflags : fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16 sse\n"
    assert rules.cpu_flags(amx) == ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert rules.precisions(rules.cpu_flags(amx)) == (
        ["float32", "bfloat16"],
        "native bf16: amx_bf16, avx512_bf16",
    )
    names, why = rules.precisions(rules.cpu_flags("flags : fpu avx2\n"))
    assert names == ["float32"] and "bfloat16 skipped" in why and "amx_bf16" in why


def test_goals_compare_with_the_fastest_peer(rules: Any) -> None:
    def figures(single: float, throughput: float, first: float = 1.0) -> dict[str, Any]:
        return {"single_request_s": single, "beam_tokens_per_s": throughput, "first_over_warm": first}

    results = {
        "float32": {
            "transformers": figures(5.0, 100.0),
            "openvino": figures(3.0, 230.0),
            "ctranslate2": {"error": "no venv"},
            "beamsplit-aggregated": figures(3.3, 460.0, 1.1),
        },
        "bfloat16": {"transformers": figures(4.0, 50.0), "beamsplit-aggregated": figures(1.5, 920.0, 1.5)},
    }
    rules.add_ratios(results)
    assert results["float32"]["beamsplit-aggregated"]["throughput_over_fastest_peer"] == 2.0
    assert results["float32"]["beamsplit-aggregated"]["single_over_fastest_peer"] == pytest.approx(1.1)
    goals = {goal["goal"]: goal for goal in rules.build_goals(results, ["float32", "bfloat16"], True)}
    assert goals["beamsplit-aggregated float32 throughput / fastest peer"]["met"] is True
    assert goals["beamsplit-aggregated float32 single request / fastest peer"]["met"] is False
    assert goals["beamsplit-aggregated bfloat16 first request / warm"]["met"] is False
    assert goals["beamsplit-aggregated float32 RSS / (weights + KV pool)"]["met"] is None  # not measured
    assert goals["beamsplit-aggregated bf16 throughput / f32"]["measured"] == 2.0
    assert goals["beamsplit-aggregated f32 single / bf16 single"]["measured"] == 2.2
    assert "beamsplit-disaggregated float32 throughput / fastest peer" not in goals  # it did not run


def test_a_failed_system_is_reported_by_its_exception_line() -> None:
    """A peer that cannot run (CTranslate2 refuses bfloat16 without native support) is skipped
    with the exception's own line, not the tail of its traceback."""
    peers = bench.load_bench_module("peers")
    traceback = (
        "Traceback (most recent call last):\n"
        '  File "bench/peers_systems.py", line 116, in load_ctranslate2\n'
        "    generator = ctranslate2.Generator(\n"
        "                ^^^^^^^^^^^^^^^^^^^^^^\n"
        "ValueError: Requested bfloat16 compute type, but the target device or backend do not support "
        "efficient bfloat16 computation.\n\n"
    )
    assert peers.failure_reason(1, traceback) == (
        "exit 1: ValueError: Requested bfloat16 compute type, but the target device or backend do not "
        "support efficient bfloat16 computation."
    )
    assert peers.failure_reason(-9, "") == "exit -9: no output on stderr"


def test_the_batch_repeats_on_prompts_of_its_own() -> None:
    """The throughput's repeats: as many batches as repeats, the first the batch whose top beams are
    compared, each of the same lengths and none sharing a prompt (beamsplit's prefix cache would
    serve a repeat); the other prompts are those drawn before the repeats existed."""
    peers = bench.load_bench_module("peers")
    workload = peers.make_workload(peers.FULL, 49152)
    batches = workload["batches"]
    assert len(batches) == peers.FULL["repeats"] == 3 and batches[0] is workload["batch"]
    lengths = [len(prompt) for prompt in workload["batch"]]
    assert all([len(prompt) for prompt in batch] == lengths for batch in batches)
    firsts = {tuple(prompt[:8]) for batch in batches for prompt in batch}
    assert len(firsts) == 3 * len(lengths)
    without = dict(peers.FULL, repeats=1)
    assert peers.make_workload(without, 49152)["batch"] == workload["batch"]
    assert peers.make_workload(without, 49152)["single"] == workload["single"]


def test_each_round_takes_its_own_warm_request_and_batch() -> None:
    peers = bench.load_bench_module("peers")
    workload = peers.make_workload(peers.FULL, 49152)
    rounds = [peers.round_workload(workload, index) for index in range(peers.FULL["repeats"])]
    for index, part in enumerate(rounds):
        assert part["warm_singles"] == [workload["warm_singles"][index]]
        assert part["batches"] == [workload["batches"][index]] and part["repeats"] == 1
        assert (part["single"], part["stream"]) == (workload["single"], workload["stream"])
    assert workload["warm_singles"][0] != workload["warm_singles"][1]


def test_rounds_merge_into_one_systems_timings(rules: Any) -> None:
    """Timings joined in round order, the batch's and the other numbers' medians over the rounds,
    resident memory's maximum, the first round's top beams; a failed round names itself."""
    rounds = [
        {"first_s": 3.0, "single_s": [2.0], "batch_runs_s": [10.0], "batch_s": 10.0, "itl_s": 0.05,
         "rss_bytes": 100, "batch_top_beams": [[1, 2]], "num_engine_processes": 2},
        {"first_s": 2.5, "single_s": [2.2], "batch_runs_s": [12.0], "batch_s": 12.0, "itl_s": 0.07,
         "rss_bytes": 300, "batch_top_beams": [[1, 3]], "num_engine_processes": 2},
        {"first_s": 2.9, "single_s": [2.1], "batch_runs_s": [11.0], "batch_s": 11.0, "itl_s": 0.06,
         "rss_bytes": 200, "batch_top_beams": [[4, 2]], "num_engine_processes": 2},
    ]  # fmt: skip
    merged = rules.merge_rounds(rounds)
    assert merged["single_s"] == [2.0, 2.2, 2.1] and merged["batch_runs_s"] == [10.0, 12.0, 11.0]
    assert (merged["batch_s"], merged["first_s"], merged["itl_s"]) == (11.0, 2.9, 0.06)
    assert merged["first_runs_s"] == [3.0, 2.5, 2.9] and merged["rss_bytes"] == 300
    assert merged["batch_top_beams"] == [[1, 2]] and merged["num_engine_processes"] == 2
    failed = rules.merge_rounds([rounds[0], {"error": "exit 1: MemoryError"}])
    assert failed["error"] == "round 2: exit 1: MemoryError"
    assert rules.merge_rounds([{"error": "no peer venv"}]) == {"error": "no peer venv"}


def test_cli_registers_peers_with_its_flags() -> None:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers(dest="command"))
    arguments = parser.parse_args(
        ["bench", "peers", "--json", "--quick", "--threads", "2", "--cache-dir", "x"]
    )
    assert (arguments.benchmark, arguments.json, arguments.quick, arguments.threads, arguments.cache_dir) == (
        "peers",
        True,
        True,
        2,
        "x",
    )


def test_quick_run_measures_beamsplit_and_transformers(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "beamsplit.cli", "bench", "peers", "--quick", "--json",
               "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    systems = report["results"]["float32"]
    for name in ("transformers", "beamsplit-aggregated", "beamsplit-disaggregated"):
        assert "error" not in systems[name], (name, systems[name])
        assert systems[name]["beam_tokens_per_s"] > 0 and systems[name]["rss_bytes"] > 0
        assert systems[name]["batch_s"] == systems[name]["batch_runs_s"][0]  # --quick: one batch
    for name in ("openvino", "ctranslate2"):
        assert "no peer venv" in systems[name]["error"]
    # Exact beam search on the same weights: every top beam equals transformers float32's.
    num_requests = report["settings"]["num_requests"]
    assert systems["beamsplit-aggregated"]["agreement"] == num_requests
    assert systems["beamsplit-disaggregated"]["agreement"] == num_requests
    assert (
        systems["beamsplit-aggregated"]["ttft_s"] > 0 and systems["beamsplit-aggregated"]["kv_pool_bytes"] > 0
    )
    assert (
        set(report["host_limits"]["gemm_flops_per_s"]) == {"float32"}
        and report["host_limits"]["copy_bytes_per_s"] > 0
    )
    goals = {goal["goal"] for goal in report["goals"]}
    assert "beamsplit-disaggregated float32 throughput / fastest peer" in goals
    assert report["bf16"].startswith(("bfloat16 skipped", "native")) and Path(report["plots"][0]).is_file()
    for phase in ("phase 1/4", "phase 2/4", "phase 3/4", "phase 4/4"):
        assert phase in result.stderr
    # The servers' logs stay for reading, and the report and the progress say where
    logs = Path(report["logs"])
    assert str(logs) in result.stderr and any(logs.glob("round-1/aggregated-float32/*.log")), sorted(
        logs.rglob("*")
    )
