"""bench/kv.py: the issue's bound, the window / all-full pairing, and the --quick run's exact bytes
and admitted requests.

The quick model (6 layers: 5 sliding of window 16, 1 full; 1 KV head of 16, float32, block 16)
has pages of 2 x 16 x 16 x 4 = 2048 B per layer and block. All-full keeps every block of all 6
layers; window-aware keeps every block of the full layer and, of the sliding layers, only the
block the next query (at position P) still sees: keys P-15 .. P-1, one block when P is a multiple
of 16.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from beamsplit.cli import bench

LAYER_PAGE = 2048  # bytes of one block of one layer in the quick model


@pytest.fixture(scope="module")
def kv() -> Any:
    return bench.load_bench_module("kv")


def test_issue_bound_for_gemma3_270m(kv: Any) -> None:
    gemma = [512] * 5 + [None]
    windows = gemma * 3  # 18 layers, 15 sliding of 512, 3 full
    assert kv.issue_bound(4096, windows, 32) == pytest.approx((3 * 4096 + 15 * 544) / (18 * 4096))
    assert kv.issue_bound(4096, windows, 32) <= 0.30 and kv.issue_bound(8192, windows, 32) <= 0.23
    assert kv.issue_bound(100, windows, 32) == 1.0  # shorter than the window: nothing to release


def test_ratio_rows_pair_the_layouts_and_refuse_a_missing_one(kv: Any) -> None:
    rows = [
        {"layout": "window", "prompt_tokens": 64, "bytes": 25},
        {"layout": "all-full", "prompt_tokens": 64, "bytes": 100},
        {"layout": "all-full", "prompt_tokens": 128, "bytes": 200},
        {"layout": "window", "prompt_tokens": 128, "bytes": 40},
    ]
    ratios = kv.ratio_rows(rows, "bytes", ["prompt_tokens"])
    assert [(row["prompt_tokens"], row["ratio"]) for row in ratios] == [(64, 0.25), (128, 0.2)]
    with pytest.raises(ValueError, match="lacks a layout"):
        kv.ratio_rows(rows[:3], "bytes", ["prompt_tokens"])


def test_quick_run_holds_and_moves_only_the_window(kv: Any, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    bench.register(subparsers)
    arguments = parser.parse_args(["bench", "kv", "--quick", "--out-dir", str(tmp_path)])
    assert kv.run(arguments) == 0  # every goal computed from the run holds
    result = json.loads((tmp_path / "kv.json").read_text())
    assert result["goals"]["beams_equal_between_layouts"] is True
    assert (tmp_path / "kv.png").stat().st_size > 0
    for prompt_len in (64, 160):
        full_blocks = prompt_len // 16
        all_full = full_blocks * 6 * LAYER_PAGE
        window = full_blocks * LAYER_PAGE + 5 * LAYER_PAGE  # the full layer's blocks + one sliding block
        moved = {
            (row["layout"], row["beam_width"]): row["transferred_bytes"]
            for row in result["moved"]
            if row["prompt_tokens"] == prompt_len
        }
        assert moved == {
            ("window", 1): window,
            ("window", 4): window,
            ("all-full", 1): all_full,
            ("all-full", 4): all_full,
        }
        held = {
            row["layout"]: row["held_after_prefill_bytes"]
            for row in result["held"]
            if row["prompt_tokens"] == prompt_len
        }
        assert held == {"window": window, "all-full": all_full}
    # Admitted at once with 256 all-full pages' bytes (1536 one-layer pages window-aware), beam 4,
    # 4 new tokens. 64 tokens: all-full 4 + 4 x 1 = 8 pages, 32; window 8 in each of the 6 groups
    # (the window never needs more than the full layout), 48 of 1536: 32 too. 160 tokens: all-full
    # 10 + 4 = 14, 18; window 14 + 5 x 10 (a sliding group holds the whole prompt while it is
    # prefilled in one chunk) = 64, 24.
    admitted = {(row["layout"], row["prompt_tokens"]): row["admitted"] for row in result["admitted"]}
    assert admitted == {("window", 64): 32, ("all-full", 64): 32, ("window", 160): 24, ("all-full", 160): 18}
    assert result["goals"]["window_admits_at_least_all_full"] is True
