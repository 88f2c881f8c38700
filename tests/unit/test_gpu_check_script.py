"""scripts/gpu_check.sh: ready for a GPU host; on a host without one it stops at once, saying so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def test_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_without_a_gpu_it_exits_2_with_one_line(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_DIR=str(tmp_path / "out"))
    finished = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert finished.returncode == 2
    assert finished.stdout == ""
    assert finished.stderr.startswith("no GPU: torch ")
    assert finished.stderr.strip().endswith("sees no CUDA device; nothing was checked")
    assert not (tmp_path / "out").exists()  # pytest never started
