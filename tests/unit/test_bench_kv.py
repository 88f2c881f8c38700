"""bench/kv.py on a tiny Gemma 3 (1 full layer, 2 sliding layers of window 8, blocks of 32): the
bytes held and moved are measured from the engines and equal the rule of docs/cache.md."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from tests.helpers.family_checkpoints import write_family_checkpoint

pytest.importorskip("transformers")


def test_held_and_moved_follow_the_window(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_kv", Path(__file__).parents[2] / "bench" / "kv.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = write_family_checkpoint(tmp_path / "gemma3", "gemma3", seed=5)
    output = io.StringIO()
    with redirect_stdout(output):
        assert bench.run(argparse.Namespace(json=True, quick=True, model=str(model), lengths="64,256")) == 0
    report = json.loads(output.getvalue())
    cases = report["cases"]
    # 64 tokens: the full layer's 2 blocks; the sliding layers keep block 1 only (the query at 64
    # sees keys 57..64): 2 + 1 x 2 one-layer pages against 2 x 3.
    assert cases["64"]["window_aware"]["blocks_in_use_per_group"] == {"full": 2, "window8": 1}
    assert cases["64"]["held_ratio"] == cases["64"]["moved_ratio"] == round(4 / 6, 4)
    # 256 tokens: 8 full blocks, 1 sliding block: (8 + 2) / 24.
    assert cases["256"]["held_ratio"] == cases["256"]["moved_ratio"] == round(10 / 24, 4)
    assert cases["256"]["all_full"]["blocks_in_use_per_group"] == {"full": 8}
    assert Path(report["plot"]).exists()
