"""The command line's OpenMP wait policy (beamsplit/cli/thread_wait.py): PASSIVE unless the
environment says otherwise, set before torch is imported so that libgomp reads it, and passed to
the servers the command line starts through their environment."""

from __future__ import annotations

import os
import subprocess
import sys

from beamsplit.cli.thread_wait import apply_default_wait_policy

# In a fresh interpreter: run `beamsplit generate --help` through main(), then report the variable
# and whether main() had imported torch (it must not have, or libgomp read the environment first).
PROBE = """
import os, sys
from beamsplit.cli import main
try:
    main(["generate", "--help"])
except SystemExit:
    pass
print(os.environ.get("OMP_WAIT_POLICY"), "torch" in sys.modules)
"""


def run_probe(extra_env: dict[str, str]) -> str:
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    env.update(extra_env)
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    return result.stdout.strip().splitlines()[-1]


def test_default_is_passive_and_a_given_policy_is_kept() -> None:
    environ: dict[str, str] = {}
    assert apply_default_wait_policy(environ, is_torch_loaded=False) == "PASSIVE"
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    given = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert apply_default_wait_policy(given, is_torch_loaded=False) is None
    assert given == {"OMP_WAIT_POLICY": "ACTIVE"}
    # Too late once torch (and libgomp) is loaded: nothing is set that would not take effect.
    late: dict[str, str] = {}
    assert apply_default_wait_policy(late, is_torch_loaded=True) is None
    assert late == {}


def test_command_line_sets_it_before_torch_loads() -> None:
    assert run_probe({}) == "PASSIVE False"
    assert run_probe({"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE False"
