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
        assert case["padded"] > 0 and case["invariant"] > 0, name
        assert abs(case["ratio"] - case["invariant"] / case["padded"]) < 0.01, name
    assert Path(report["plot"]).stat().st_size > 0
