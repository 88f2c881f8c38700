"""`beamsplit bench invariance --quick`: both settings measured, ratios follow from the times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_reports_both_settings(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "beamsplit.cli", "bench", "invariance", "--quick", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report["model"] == "llama-small"
    assert set(report["cases"]) == {"prefill_128_ms", "decode_step_1x_beam1_ms", "decode_step_2x_beam4_ms"}
    for name, case in report["cases"].items():
        padded, invariant = case["padded"], case["invariant"]
        assert padded > 0 and invariant > 0, name
        # The times are rounded to 0.001 ms and the ratio to 0.001 from the unrounded times, so
        # the ratio of the printed times may differ from the printed ratio by that much at most.
        half = 0.0005
        slack = half + (half + half * invariant / padded) / (padded - half)
        assert abs(case["ratio"] - invariant / padded) <= slack, (name, case)
    assert Path(report["plot"]).stat().st_size > 0
