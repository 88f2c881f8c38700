"""bench/soak.py's accounting: every request lands in exactly one of served, refused, lost."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from beamsplit.cli import bench


@pytest.fixture(scope="module")
def soak() -> Any:
    return bench.load_bench_module("soak")


def test_classify_counts_each_request_once(soak: Any) -> None:
    outcomes = ["ok", "ok", "UNAVAILABLE", "RESOURCE_EXHAUSTED", "lost", "DEADLINE_EXCEEDED", "INTERNAL"]
    result = soak.classify(outcomes)
    assert result["requests"] == 7
    assert (result["served"], result["refused"], result["lost"]) == (2, 2, 3)
    assert result["refused_by_status"] == {"UNAVAILABLE": 1, "RESOURCE_EXHAUSTED": 1}
    assert result["lost_by_kind"] == {"lost": 1, "DEADLINE_EXCEEDED": 1, "INTERNAL": 1}
    assert result["served"] + result["refused"] + result["lost"] == result["requests"]


def test_per_bucket_and_rss_since_restart(soak: Any) -> None:
    assert soak._per_bucket([0.5, 9.9, 10.0, 31.0], 10.0) == [2, 1, 0, 1]
    samples = [
        {"t": 0.0, "rss_mib": {"a": 100.0, "b": 50.0}},
        {"t": 60.0, "rss_mib": {"a": 300.0, "b": 51.0}},
        {"t": 65.0, "rss_mib": {"a": 120.0, "b": 52.0}},
    ]
    summary = soak._rss_summary(samples, [{"t": 60.0, "worker": "a"}])
    assert summary == {"a": {"first": 120.0, "last": 120.0, "max": 120.0},
                       "b": {"first": 50.0, "last": 52.0, "max": 52.0}}  # fmt: skip


def test_cli_registers_soak_with_minutes() -> None:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    arguments = parser.parse_args(["bench", "soak", "--json", "--minutes", "2"])
    assert arguments.minutes == 2.0 and arguments.json and arguments.concurrency == 16
