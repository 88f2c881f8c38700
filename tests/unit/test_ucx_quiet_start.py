"""A UCX context starts without warnings the user did not cause (issue 30).

ucxx sets UCX_MEMTYPE_CACHE on import, which the UCX it ships no longer knows: every worker log
started with "UCX WARN unused environment variable: UCX_MEMTYPE_CACHE". Each case runs in a fresh
interpreter, since the import and UCX's one-time environment check happen once per process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from transfer.ucx_binding import installed_bindings

pytestmark = pytest.mark.skipif(not installed_bindings(), reason="no UCX binding installed")

PROGRAM = """
import os
from transfer.ucx_binding import load_binding
binding = load_binding()
print("MEMTYPE_CACHE=" + os.environ.get("UCX_MEMTYPE_CACHE", "<unset>"))
binding.close()
"""


def _run(extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("UCX_")}
    return subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env={**env, **extra_env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def test_a_fresh_context_prints_no_ucx_warning() -> None:
    result = _run({})
    assert "WARN" not in result.stderr, result.stderr
    assert "MEMTYPE_CACHE=<unset>" in result.stdout


def test_a_value_the_user_set_is_kept() -> None:
    result = _run({"UCX_MEMTYPE_CACHE": "n"})
    assert "MEMTYPE_CACHE=n" in result.stdout  # their setting reaches UCX untouched
