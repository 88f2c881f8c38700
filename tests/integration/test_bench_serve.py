"""`beamsplit bench serve --quick` end to end on a small random Llama: four servers, the replay on
both deployments and through transformers, the requests alone, the JSON and the plots.

The numbers must add up, not only exist: every request of the workload finished on every system
with W x max_new_tokens beam tokens, throughput is those tokens over the wall time, percentiles are
ordered, the beam-4 request held at most its prompt plus 4 tails, each goal's verdict follows from
its ratio, and every KV pool is back to 0. On a timeout the benchmark gets SIGINT, which makes it
stop its servers by pid before the test fails.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from beamsplit.cli import bench

BENCH_TIMEOUT_S = 240.0
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_bench(arguments: list[str]) -> tuple[int, str, str]:
    command = [sys.executable, "-m", "beamsplit.cli", "bench", "serve", *arguments]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)  # its finally stops the servers
        try:
            stdout, stderr = process.communicate(timeout=60.0)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        raise AssertionError(f"bench serve ran past {BENCH_TIMEOUT_S:.0f} s:\n{stderr}") from None
    return process.returncode, stdout, stderr


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    out_dir = tmp_path_factory.mktemp("bench-serve")
    arguments = ["--json", "--quick", "--model", "llama-small", "--model-dir", str(out_dir / "models"),
                 "--out-dir", str(out_dir / "plots"), "--num-requests", "5", "--rate", "4"]  # fmt: skip
    returncode, stdout, stderr = run_bench(arguments)
    assert returncode == 0, stderr
    return json.loads(stdout), stderr, out_dir


def test_every_request_made_its_tokens_on_every_system(quick_run: tuple[dict[str, Any], str, Path]) -> None:
    report, _, _ = quick_run
    serve = bench.load_bench_module("serve")
    workload = report["workload"]
    assert workload["num_requests"] == 5 and workload["max_new_tokens"] == serve.QUICK["max_new_tokens"]
    widths = {int(width): count for width, count in workload["requests_per_beam_width"].items()}
    assert sum(widths.values()) == 5
    expected_tokens = sum(width * count for width, count in widths.items()) * workload["max_new_tokens"]
    assert set(report["systems"]) == {"disaggregated", "aggregated", "transformers"}
    for name, system in report["systems"].items():
        assert system["requests_ok"] == system["requests"] == 5, (name, system)
        assert system["errors"] == []
        assert system["generated_beam_tokens"] == expected_tokens, name
        assert system["wall_s"] > 0
        assert system["beam_tokens_per_s"] == pytest.approx(expected_tokens / system["wall_s"], rel=1e-3)
        assert 0 < system["ttft_ms_p50"] <= system["ttft_ms_p99"]
        assert 0 <= system["itl_ms_p50"] <= system["itl_ms_p99"]
        assert system["peak_kv_bytes"] > 0
    assert report["checks"]["token_counts_consistent"] is True
    assert report["checks"]["problems"] == []
    assert set(report["checks"]["kv_blocks_in_use_after"].values()) == {0.0}


def test_probes_and_the_beam_kv_bound(quick_run: tuple[dict[str, Any], str, Path]) -> None:
    report, _, _ = quick_run
    model = report["model"]
    page_bytes = 32 * model["num_layers"] * 2 * model["num_kv_heads"] * model["head_dim"] * 4
    assert report["servers"]["page_bytes"] == page_bytes
    kv = report["beam4_kv"]
    assert kv["prompt_plus_tails_blocks"] < kv["independent_copies_blocks"]
    for name in ("disaggregated", "aggregated"):
        # The request's own counter: at least the shared prompt and one block per beam, at most the bound.
        assert kv["shared_prompt_blocks"] + 4 <= kv[f"{name}_peak_blocks"] <= kv["prompt_plus_tails_blocks"]
        assert kv[f"{name}_peak_bytes"] == kv[f"{name}_peak_blocks"] * page_bytes
    ttft = report["ttft_long_prompt_alone"]
    assert ttft["prompt_tokens"] == bench.load_bench_module("serve").QUICK["max_prompt_len"]
    for name in ("disaggregated", "aggregated"):
        assert len(ttft[f"{name}_ttft_ms_all"]) == ttft["repeats"]
    itl = report["single_request_itl"]
    for name in ("disaggregated", "aggregated", "transformers"):
        assert 0 <= itl[name]["itl_ms_p50"] <= itl[name]["itl_ms_p99"], name


def test_goals_follow_from_their_ratios(quick_run: tuple[dict[str, Any], str, Path]) -> None:
    report, stderr, _ = quick_run
    goals = report["goals"]
    assert len(goals) == 6
    systems = report["systems"]
    throughput = goals[0]
    assert throughput["measured"] == pytest.approx(
        systems["disaggregated"]["beam_tokens_per_s"] / systems["transformers"]["beam_tokens_per_s"], abs=1e-3
    )
    for goal in goals:
        assert goal["measured"] is not None, goal
        bound_met = (
            goal["measured"] >= goal["bound"]
            if goal["direction"] == ">="
            else goal["measured"] <= goal["bound"]
        )
        # `met` is decided on the unrounded ratio; it agrees with the rounded one away from the bound.
        if abs(goal["measured"] - goal["bound"]) > 1e-3:
            assert goal["met"] is bound_met, goal
        assert f"goal {goal['goal']}:" in stderr


def test_plots_are_written_and_named(quick_run: tuple[dict[str, Any], str, Path]) -> None:
    report, stderr, out_dir = quick_run
    assert [Path(path).name for path in report["plots"]] == ["serve_summary.png", "serve_cdf.png"]
    for path in report["plots"]:
        assert Path(path).parent == out_dir / "plots"
        assert Path(path).read_bytes()[:8] == PNG_MAGIC
        assert f"plot: {path}" in stderr
