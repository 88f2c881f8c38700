"""Session hooks: a session that will run the lm-eval test builds lm-eval's venv in the background
from collection on (tests/helpers/lm_eval_venv.py), and ends that build if it outlives the session.

The suite runs servers beside each other and beside in-process engines on a few cores: every
process it starts, and this one, waits at OpenMP barriers asleep (OMP_WAIT_POLICY=PASSIVE, set
before torch loads), as beamsplit chooses for shared cores (beamsplit/cli/thread_wait.py, whose own
tests clear it). A policy already in the environment is kept."""

from __future__ import annotations

import os
import subprocess

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from tests.helpers.lm_eval_venv import start_background_build, stop_background_build

LM_EVAL_TESTS = "tests/integration/test_lm_eval.py::test_lm_eval"
_BUILD = pytest.StashKey[subprocess.Popen[bytes] | None]()


def pytest_collection_finish(session: pytest.Session) -> None:
    if any(item.nodeid.startswith(LM_EVAL_TESTS) for item in session.items):
        session.config.stash[_BUILD] = start_background_build()


def pytest_sessionfinish(session: pytest.Session) -> None:
    stop_background_build(session.config.stash.get(_BUILD, None))
