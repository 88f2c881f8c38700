"""lm-eval in a virtual environment of its own, made on first use.

lm-eval pulls torch, transformers and datasets versions of its own choosing; kept apart from the
project's .venv, it cannot replace the pinned torch there. torch is pinned to the project's
2.13.0 in this venv too, so pip takes the local CPU wheel and never a CUDA build. The venv lives in
`.cache/lm-eval-venv` (ignored by git) and is reused; a fresh clone builds it once: 804 s of wall
time (2 min of CPU) on this project's shared 2-core host while other jobs ran, from the local
wheel mirror (pip resolves and installs ~90 packages).

Usage: `python -m tests.helpers.lm_eval_venv` builds it and prints its lm_eval path.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import time
from pathlib import Path

LM_EVAL_REQUIREMENT = "lm-eval[api,hf]==0.4.13"
TORCH_REQUIREMENT = "torch==2.13.0"
REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_DIR = REPO_ROOT / ".cache" / "lm-eval-venv"
INSTALL_TIMEOUT_S = 1200.0


def lm_eval_executable(venv_dir: Path = VENV_DIR) -> Path:
    """The venv's `lm_eval`, installing the venv first when it is missing or incomplete."""
    executable = venv_dir / "bin" / "lm_eval"
    marker = venv_dir / ".complete"  # written last: a half-made venv is made again
    if marker.is_file() and executable.is_file():
        return executable
    venv_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(venv_dir.parent / "lm-eval-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test processes must not build it at once
        if marker.is_file() and executable.is_file():
            return executable
        started = time.monotonic()
        print(f"lm-eval venv: creating {venv_dir} ({LM_EVAL_REQUIREMENT}, {TORCH_REQUIREMENT})", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv_dir)], check=True, timeout=300)
        subprocess.run(
            [
                str(venv_dir / "bin" / "python"), "-m", "pip", "install", "--quiet",
                "--disable-pip-version-check", LM_EVAL_REQUIREMENT, TORCH_REQUIREMENT,
            ],
            check=True,
            timeout=INSTALL_TIMEOUT_S,
        )  # fmt: skip
        marker.write_text(f"{LM_EVAL_REQUIREMENT} {TORCH_REQUIREMENT}\n")
        print(f"lm-eval venv: ready in {time.monotonic() - started:.0f} s", flush=True)
    return executable


if __name__ == "__main__":
    print(lm_eval_executable())
