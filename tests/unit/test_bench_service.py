"""bench/service.py's pure helpers: medians per case, the bytes-per-W check, the CLI registration."""

from __future__ import annotations

import argparse
import random
from typing import Any

import pytest

from beamsplit.cli import bench


@pytest.fixture(scope="module")
def service() -> Any:
    return bench.load_bench_module("service")


def _sample(e2e: float, aggregated_e2e: float, nbytes: int = 32768, match: bool = True) -> dict[str, Any]:
    return {
        "transferred_blocks": nbytes // 16384,
        "transferred_bytes": nbytes,
        "transfer_ms": 1.0,
        "ttft_ms": 10.0,
        "e2e_ms": e2e,
        "aggregated_ttft_ms": 5.0,
        "aggregated_e2e_ms": aggregated_e2e,
        "tokens_match": match,
    }


def test_summarize_takes_medians_and_the_ratio(service: Any) -> None:
    row = service.summarize(
        "fresh", 64, 4, [_sample(100.0, 50.0), _sample(300.0, 100.0), _sample(200.0, 400.0)]
    )
    assert row["case"] == "fresh" and row["prompt_tokens"] == 64 and row["beam_width"] == 4
    assert row["e2e_ms"] == 200.0 and row["aggregated_e2e_ms"] == 100.0 and row["e2e_ratio"] == 2.0
    # decode = e2e - ttft per sample (ttft 10 and 5 ms): medians 190 and 95 ms
    assert row["decode_ms"] == 190.0 and row["aggregated_decode_ms"] == 95.0 and row["decode_ratio"] == 2.0
    assert row["transferred_bytes"] == 32768 and isinstance(row["transferred_bytes"], int)
    assert row["tokens_match"] is True and row["repeats"] == 3
    assert "transferred_bytes_seen" not in row


def test_summarize_reports_a_mismatch_and_a_spread(service: Any) -> None:
    row = service.summarize("fresh", 64, 2, [_sample(1.0, 1.0), _sample(1.0, 1.0, nbytes=16384, match=False)])
    assert row["tokens_match"] is False
    assert row["transferred_bytes_seen"] == [16384, 32768]
    with pytest.raises(ValueError):
        service.summarize("fresh", 64, 2, [])


def test_bytes_by_width_groups_fresh_rows_by_prompt(service: Any) -> None:
    rows = [
        service.summarize("fresh", 512, width, [_sample(1.0, 1.0, nbytes=262144)]) for width in (1, 2, 4, 8)
    ]
    rows.append(service.summarize("reuse", 512, 4, [_sample(1.0, 1.0, nbytes=16384)]))
    assert service.bytes_by_width(rows) == {512: {262144}}


def test_random_prompt_is_bytes_of_the_requested_length(service: Any) -> None:
    prompt = service.random_prompt(random.Random(0), 100)
    assert len(prompt) == 100 and all(0 <= token < 256 for token in prompt)


def test_registered_as_bench_service() -> None:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    arguments = parser.parse_args(["bench", "service", "--quick", "--json"])
    assert arguments.benchmark == "service" and arguments.quick and arguments.json
    assert not arguments.shared_cores
    assert parser.parse_args(["bench", "service", "--shared-cores"]).shared_cores
