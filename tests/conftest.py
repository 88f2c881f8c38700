"""Session hooks: a session that will run the lm-eval test builds lm-eval's venv in the background
from collection on (tests/helpers/lm_eval_venv.py), and ends that build if it outlives the session."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers.lm_eval_venv import start_background_build, stop_background_build

LM_EVAL_TESTS = "tests/integration/test_lm_eval.py::test_lm_eval"
_BUILD = pytest.StashKey[subprocess.Popen[bytes] | None]()


def pytest_collection_finish(session: pytest.Session) -> None:
    if any(item.nodeid.startswith(LM_EVAL_TESTS) for item in session.items):
        session.config.stash[_BUILD] = start_background_build()


def pytest_sessionfinish(session: pytest.Session) -> None:
    stop_background_build(session.config.stash.get(_BUILD, None))
