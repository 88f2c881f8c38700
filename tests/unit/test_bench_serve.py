"""bench/serve*.py's pure parts: the workload, the latency arithmetic, the checks and the goals."""

from __future__ import annotations

import argparse
import io
import math
from typing import Any

import pytest

from beamsplit.cli import bench


@pytest.fixture(scope="module")
def serve() -> Any:
    return bench.load_bench_module("serve")


def _config(serve: Any, **changes: Any) -> Any:
    values = dict(
        num_requests=60, rate=2.0, min_prompt_len=128, max_prompt_len=4096, max_new_tokens=8,
        beam_widths=(1, 2, 4), prefix_share=0.5, num_prefixes=2, vocab_size=32000, seed=3,
    )  # fmt: skip
    values.update(changes)
    return serve.workload.WorkloadConfig(**values)


def test_workload_is_seeded_and_within_its_bounds(serve: Any) -> None:
    config = _config(serve)
    specs = serve.workload.make_workload(config)
    assert specs == serve.workload.make_workload(config)
    assert specs != serve.workload.make_workload(_config(serve, seed=4))
    assert [spec.index for spec in specs] == list(range(60))
    assert specs[0].arrival_s == 0.0
    assert all(later.arrival_s > earlier.arrival_s for earlier, later in zip(specs, specs[1:], strict=False))
    assert all(128 <= len(spec.prompt_ids) <= 4096 for spec in specs)
    assert all(3 <= token < 32000 for spec in specs for token in spec.prompt_ids)
    assert [spec.beam_width for spec in specs[:6]] == [1, 2, 4, 1, 2, 4]
    assert all(spec.num_beam_tokens == spec.beam_width * 8 for spec in specs)


def test_shared_prefixes_are_shared(serve: Any) -> None:
    config = _config(serve)
    specs = serve.workload.make_workload(config)
    by_prefix: dict[int, set[tuple[int, ...]]] = {}
    for spec in specs:
        if spec.prefix_index is not None:
            by_prefix.setdefault(spec.prefix_index, set()).add(spec.prompt_ids[: config.prefix_len])
    assert config.prefix_len == 1024
    assert sorted(by_prefix) == [0, 1]
    assert all(len(prefixes) == 1 for prefixes in by_prefix.values())
    assert by_prefix[0] != by_prefix[1]
    unshared = serve.workload.make_workload(_config(serve, prefix_share=0.0))
    assert all(spec.prefix_index is None for spec in unshared)


def test_workload_config_names_the_bad_field(serve: Any) -> None:
    with pytest.raises(ValueError, match="rate"):
        _config(serve, rate=0.0)
    with pytest.raises(ValueError, match="max_prompt_len"):
        _config(serve, min_prompt_len=512, max_prompt_len=256)
    with pytest.raises(ValueError, match="prefix_share"):
        _config(serve, prefix_share=1.5)


def test_percentile_interpolates_like_numpy(serve: Any) -> None:
    percentile = serve.workload.percentile
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.99) == pytest.approx(4.96)
    assert percentile([7.0], 0.99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 0.5)


def _record(serve: Any, times: list[float], counts: list[int], beam_width: int = 1, sent: float = 0.0) -> Any:
    record = serve.workload.RequestRecord(index=0, beam_width=beam_width, sent_s=sent)
    record.step_times_s, record.step_counts = times, counts
    record.num_beam_tokens = beam_width * sum(counts)
    record.end_s = times[-1]
    return record


def test_a_message_with_k_steps_counts_as_k_gaps(serve: Any) -> None:
    record = _record(serve, [1.0, 1.5, 2.5], [2, 1, 4])
    assert record.ttft_s == 1.0
    assert record.inter_token_gaps_s() == [0.5, 0.25, 0.25, 0.25, 0.25]


def test_summary_throughput_and_ordered_percentiles(serve: Any) -> None:
    fast = _record(serve, [0.1, 0.2, 0.3], [1, 1, 1], beam_width=2)
    slow = _record(serve, [1.0, 3.0], [1, 1], beam_width=4, sent=0.5)
    failed = serve.workload.RequestRecord(index=2, beam_width=1, sent_s=0.2, error="UNAVAILABLE: gone")
    summary = serve.workload.summarize_system([fast, slow, failed])
    assert summary["requests"] == 3 and summary["requests_ok"] == 2
    assert summary["errors"] == ["UNAVAILABLE: gone"]
    assert summary["generated_beam_tokens"] == 2 * 3 + 4 * 2
    assert summary["wall_s"] == 3.0  # first arrival 0.0 to last final 3.0
    assert summary["beam_tokens_per_s"] == pytest.approx(14 / 3.0, abs=1e-3)
    assert summary["ttft_ms_p50"] <= summary["ttft_ms_p99"]
    assert summary["itl_ms_p50"] == 100.0 and summary["itl_ms_p99"] <= 2000.0


def test_token_count_problems_catch_short_streams(serve: Any) -> None:
    specs = serve.workload.make_workload(_config(serve, num_requests=3, max_new_tokens=2))
    good = []
    for spec in specs:
        record = _record(serve, [1.0, 2.0], [1, 1], beam_width=spec.beam_width)
        record.final_lengths = [2] * spec.beam_width
        good.append(record)
    assert serve.report_rules.token_count_problems("x", specs, good) == []
    good[2].num_beam_tokens -= 1
    good[1].final_lengths = [2, 1]
    problems = serve.report_rules.token_count_problems("x", specs, good)
    assert problems == ["x request 1: beam lengths [2, 1]", "x request 2: 7 beam tokens, expected 8"]


def test_beam_kv_report_counts_blocks(serve: Any) -> None:
    # 401-token prompt, 32 new, block 32: 12 full prompt blocks; 433 tokens span 14 blocks.
    kv = serve.report_rules.beam_kv_report(401, 32, 4, 524288)
    assert kv["shared_prompt_blocks"] == 12 and kv["tail_blocks_per_beam"] == 2
    assert kv["prompt_plus_tails_blocks"] == 12 + 4 * 2
    assert kv["independent_copies_blocks"] == 4 * math.ceil(433 / 32) == 56


def _report(
    tps: dict[str, float], itl: tuple[float, float], ttft: tuple[float | None, float], peaks: int
) -> dict[str, Any]:
    return {
        "systems": {name: {"beam_tokens_per_s": value} for name, value in tps.items()},
        "single_request_itl": {"aggregated": {"itl_ms_p50": itl[0]}, "transformers": {"itl_ms_p50": itl[1]}},
        "ttft_long_prompt_alone": {"prompt_tokens": 4096, "disaggregated_ttft_ms": ttft[0], "aggregated_ttft_ms": ttft[1]},
        "beam4_kv": {"prompt_plus_tails_blocks": 20, "disaggregated_peak_blocks": peaks, "aggregated_peak_blocks": 20},
    }  # fmt: skip


def test_goals_compare_measured_ratios_with_their_bounds(serve: Any) -> None:
    report = _report(
        {"disaggregated": 30.0, "aggregated": 10.0, "transformers": 10.0}, (12.0, 10.0), (110.0, 100.0), 21
    )
    goals = {goal["goal"]: goal for goal in serve.report_rules.build_goals(report)}
    assert len(goals) == 6
    assert goals["disaggregated throughput >= 2x transformers"]["measured"] == 3.0
    assert goals["disaggregated throughput >= 2x transformers"]["met"] is True
    assert goals["aggregated throughput >= 2x transformers"]["met"] is False
    assert goals["single-request inter-token latency <= 1.2x transformers"]["met"] is True  # 1.2 exactly
    assert goals["disaggregated TTFT <= 1.1x aggregated (4096-token prompt)"]["measured"] == 1.1
    assert goals["disaggregated beam-4 KV <= shared prompt + 4 tails"]["met"] is False  # 21 > 20
    assert goals["aggregated beam-4 KV <= shared prompt + 4 tails"]["met"] is True


def test_the_arrival_ceiling_is_named_next_to_the_throughput_goal(serve: Any) -> None:
    """1440 beam tokens arriving over 57.3 s: no system beats 25.1 beam tok/s, 2.24x a transformers
    run of 11.2; the goal's text says so. Everything at once: no ceiling."""
    specs = [
        serve.workload.RequestSpec(0, 0.0, (5,), 4, 32, None),
        serve.workload.RequestSpec(1, 57.3, (5,), 4, 328, None),
    ]
    assert serve.workload.arrival_ceiling(specs) == round(1440 / 57.3, 3)
    report = _report(
        {"disaggregated": 9.0, "aggregated": 7.0, "transformers": 11.2}, (1.0, 1.0), (1.0, 1.0), 20
    )
    report["workload"] = {"arrival_ceiling_beam_tokens_per_s": 25.131}
    goals = {goal["goal"]: goal for goal in serve.report_rules.build_goals(report)}
    how = goals["disaggregated throughput >= 2x transformers"]["how"]
    assert how.endswith("the arrivals cap any system at 25.131 beam tok/s, 2.24x transformers"), how
    at_once = [serve.workload.RequestSpec(index, 0.0, (5,), 1, 8, None) for index in range(3)]
    assert serve.workload.arrival_ceiling(at_once) is None


def test_an_unmeasured_goal_is_neither_met_nor_failed(serve: Any) -> None:
    report = _report({"disaggregated": 30.0, "aggregated": 30.0}, (1.0, 1.0), (None, 100.0), 20)
    goals = {goal["goal"]: goal for goal in serve.report_rules.build_goals(report)}
    assert goals["disaggregated throughput >= 2x transformers"]["met"] is None
    assert goals["disaggregated TTFT <= 1.1x aggregated (4096-token prompt)"]["measured"] is None


def test_transformers_batches_one_width_and_similar_lengths(serve: Any) -> None:
    reference = bench.load_bench_module("serve_transformers")
    spec = serve.workload.RequestSpec
    waiting = [
        spec(0, 0.0, (5,) * 1000, 2, 8, None),
        spec(1, 0.1, (5,) * 100, 2, 8, None),  # too short for the oldest's batch
        spec(2, 0.2, (5,) * 1500, 4, 8, None),  # another width
        spec(3, 0.3, (5,) * 1999, 2, 8, None),
        spec(4, 0.4, (5,) * 600, 2, 8, None),
    ]
    assert [chosen.index for chosen in reference.pick_batch(waiting)] == [0, 3, 4]
    assert [chosen.index for chosen in reference.pick_batch(waiting, max_rows=4)] == [0, 3]
    assert [chosen.index for chosen in reference.pick_batch(waiting[2:], max_rows=4)] == [2]
    # 2 requests x 2 beams x 1999 padded tokens > 7000: the longest does not fit, 2 x 2 x 1000 does.
    assert [chosen.index for chosen in reference.pick_batch(waiting, max_tokens=7000)] == [0, 4]
    assert [chosen.index for chosen in reference.pick_batch(waiting, max_tokens=100)] == [
        0
    ]  # the oldest always goes


def test_progress_bar_writes_tenths_when_not_a_terminal(serve: Any) -> None:
    stream = io.StringIO()
    bar = serve.progress.ProgressBar("phase", 20, stream)
    for _ in range(20):
        bar.advance()
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 11  # 0/20, then one per tenth
    assert "20/20" in lines[-1] and "#" * 28 in lines[-1]


def test_cli_registers_serve_with_its_flags(serve: Any) -> None:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    arguments = parser.parse_args(
        ["bench", "serve", "--json", "--quick", "--num-requests", "3", "--rate", "1.5"]
    )
    assert arguments.benchmark == "serve" and arguments.json and arguments.quick
    settings = serve.resolve_settings(arguments)
    assert settings == {**serve.QUICK, "num_requests": 3, "rate": 1.5}
    full = serve.resolve_settings(parser.parse_args(["bench", "serve", "--max-prompt-len", "512"]))
    assert full == {**serve.FULL, "max_prompt_len": 512}
    with pytest.raises(ValueError, match="--model"):
        serve.resolve_settings(parser.parse_args(["bench", "serve", "--model", "gpt-9"]))


def test_serve_help_states_the_defaults_the_script_uses(serve: Any) -> None:
    parser = argparse.ArgumentParser()
    bench.add_serve_arguments(parser)
    help_by_flag = {action.dest: action.help or "" for action in parser._actions}
    for key in serve.FULL:
        assert f"(default: {serve.FULL[key]}; --quick: {serve.QUICK[key]})" in help_by_flag[key], key
