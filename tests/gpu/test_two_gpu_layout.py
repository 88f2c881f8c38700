"""deploy/two_gpu.sh on GPUs: the CPU smoke test's checks (tests/integration/test_two_gpu_script.py)
with the workers on CUDA devices.

Context worker on cuda:0, generation worker on cuda:1 (both on cuda:0 when only one GPU is
visible: two processes on one GPU), aggregated reference on cuda:0; requests through the
coordinator must equal the reference's beams exactly, in float32 and bfloat16; pools empty; clean
exits on SIGINT. Marked `gpu`: deselected by default, skipped without a CUDA device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.two_gpu_script import check_parity_and_clean_stop, running_script

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.timeout(240),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_gpu_script_on_cuda_parity_and_clean_stop(tmp_path: Path, dtype: str) -> None:
    generation_gpu = "1" if torch.cuda.device_count() >= 2 else "0"
    with running_script(
        tmp_path, dtype, DEVICE="cuda", CONTEXT_GPU="0", GENERATION_GPU=generation_gpu
    ) as deployment:
        check_parity_and_clean_stop(deployment)
