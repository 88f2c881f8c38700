"""lm-eval in a virtual environment of its own, made on first use.

lm-eval pulls torch, transformers and datasets versions of its own choosing; kept apart from the
project's .venv, it cannot replace the pinned torch there. torch is pinned to the project's
2.13.0 in this venv too, so pip takes the local CPU wheel and never a CUDA build. The venv lives in
`.cache/lm-eval-venv` (ignored by git) and is reused; a fresh clone builds it once: 804 s of wall
time (2 min of CPU) on this project's shared 2-core host while other jobs ran, from the local
wheel mirror (pip resolves and installs ~90 packages).

A test session that will run the lm-eval test starts the build in the background when it
collects it (tests/conftest.py), so pip works while the other tests run; the test then waits on
the same lock. Usage: `python -m tests.helpers.lm_eval_venv` builds it and prints its lm_eval path.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LM_EVAL_REQUIREMENT = "lm-eval[api,hf]==0.4.13"
TORCH_REQUIREMENT = "torch==2.13.0"
REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_DIR = REPO_ROOT / ".cache" / "lm-eval-venv"
INSTALL_TIMEOUT_S = 1200.0


def is_built(venv_dir: Path = VENV_DIR) -> bool:
    return (venv_dir / ".complete").is_file() and (venv_dir / "bin" / "lm_eval").is_file()


def start_background_build(venv_dir: Path = VENV_DIR) -> subprocess.Popen[bytes] | None:
    """Builds the venv in a child process (its output in .cache/lm-eval-venv.log); None when built."""
    if is_built(venv_dir):
        return None
    venv_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(venv_dir.parent / "lm-eval-venv.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.lm_eval_venv", str(venv_dir)],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its pip children form one group, ended together
        )


def stop_background_build(process: subprocess.Popen[bytes] | None, timeout_s: float = 30.0) -> None:
    """Ends a build still running (the session is over); a half-made venv is made again next time."""
    if process is None or process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=timeout_s)


def lm_eval_executable(venv_dir: Path = VENV_DIR) -> Path:
    """The venv's `lm_eval`, installing the venv first when it is missing or incomplete."""
    executable = venv_dir / "bin" / "lm_eval"
    marker = venv_dir / ".complete"  # written last: a half-made venv is made again
    if is_built(venv_dir):
        return executable
    venv_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(venv_dir.parent / "lm-eval-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test processes must not build it at once
        if is_built(venv_dir):
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
    print(lm_eval_executable(Path(sys.argv[1]) if len(sys.argv) > 1 else VENV_DIR))
