"""`deploy/two_gpu.sh` with DEVICE=cpu: the launcher a user runs, as a CI smoke test.

The script starts context worker, generation worker, coordinator and (AGGREGATED_PORT) an
aggregated reference on free ports with `tiny`; requests go through the coordinator and must
equal the aggregated server's beams; the pools read 0 on every worker's /metrics; SIGINT (what
Ctrl-C sends) must stop every server by pid with exit 0. Without CUDA, the default DEVICE=cuda
must fail fast with the worker's one-line error. The same check on GPUs: tests/gpu/.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch

from beamsplit.launch.launcher import PortPicker
from tests.helpers.two_gpu_script import (
    HOST,
    REPO,
    SCRIPT,
    check_parity_and_clean_stop,
    running_script,
    script_env,
)

pytestmark = pytest.mark.timeout(240)


def test_script_serves_with_parity_and_stops_every_server_on_sigint(tmp_path: Path) -> None:
    with running_script(tmp_path, "float32", DEVICE="cpu") as deployment:
        check_parity_and_clean_stop(deployment)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_default_cuda_layout_on_a_cpu_host_fails_fast_with_one_line(tmp_path: Path) -> None:
    env = script_env(PortPicker(HOST), tmp_path, DEVICE="cuda")
    env.pop("AGGREGATED_PORT")
    started = time.monotonic()
    finished = subprocess.run(
        ["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert finished.returncode == 1
    assert time.monotonic() - started < 60
    assert "exited while starting" in finished.stderr
    assert "error: --device cuda:0: CUDA is not available on this host" in finished.stderr
    assert "Traceback" not in finished.stderr
