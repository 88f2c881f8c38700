"""The command line's OpenMP wait policy (beamsplit/cli/thread_wait.py): PASSIVE where cores are
busy, libgomp's default spin set explicitly for workers that take turns on shared cores, libgomp's default where an engine
server has its cores to itself, the user's value always kept; chosen before torch is imported so
that libgomp reads it."""

from __future__ import annotations

import os
import subprocess
import sys

from beamsplit.cli.thread_wait import (
    CHOICE_VARIABLE,
    SPIN_COUNT_VARIABLE,
    TURN_SPIN,
    TURN_SPIN_COUNT,
    WAIT_POLICY_VARIABLE,
    apply_wait_policy,
    choose_wait_policy,
    describe_wait_policy,
    idle_cpus,
)

# In a fresh interpreter: run `beamsplit ARGS --help` through main(), then report the variables and
# whether main() had imported torch (it must not have, or libgomp read the environment first).
PROBE = """
import os, sys
from beamsplit.cli import main
try:
    main(sys.argv[1:] + ["--help"])
except SystemExit:
    pass
print(os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
"""


def run_probe(arguments: list[str], extra_env: dict[str, str]) -> str:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in (WAIT_POLICY_VARIABLE, SPIN_COUNT_VARIABLE, CHOICE_VARIABLE)
    }
    env.update(extra_env)
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *arguments],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    return result.stdout.strip().splitlines()[-1]


def test_an_engine_server_spins_only_on_cores_of_its_own() -> None:
    two_threads = {"OMP_NUM_THREADS": "2"}
    assert choose_wait_policy(["serve", "aggregated", "--model", "m"], two_threads, lambda: 1.9)[0] is None
    assert choose_wait_policy(["generate", "--model", "m"], two_threads, lambda: 2.0)[0] is None
    # Another job holds a CPU: too few idle for 2 threads.
    policy, why = choose_wait_policy(["serve", "aggregated"], two_threads, lambda: 1.2)
    assert policy == "PASSIVE" and why == "1.2 CPUs idle at start-up for 2 threads"
    # One thread needs one idle CPU.
    assert choose_wait_policy(["serve", "aggregated"], {"OMP_NUM_THREADS": "1"}, lambda: 1.2)[0] is None

    # The other worker of a one-host deployment computes beside it: no sampling needed.
    def never() -> float:
        raise AssertionError("sampled the CPUs for a worker that shares its cores")

    assert choose_wait_policy(["serve", "context", "--shares-cores"], two_threads, never) == (
        TURN_SPIN, "--shares-cores: turns on the cores",
    )  # fmt: skip
    # Launchers, benchmarks and tools: PASSIVE for themselves.
    for argv in (["demo"], ["bench", "peers"], ["status"], ["serve", "coordinator"]):
        assert choose_wait_policy(argv, two_threads, never) == ("PASSIVE", "not an engine server")


def test_a_chosen_policy_is_chosen_again_by_a_child_and_the_users_is_kept() -> None:
    environ: dict[str, str] = {}
    why = apply_wait_policy(["bench", "peers"], environ, is_torch_loaded=False)
    assert environ == {WAIT_POLICY_VARIABLE: "PASSIVE", CHOICE_VARIABLE: "not an engine server"} and why
    # A server the benchmark starts inherits that environment and chooses for itself.
    child = dict(environ, OMP_NUM_THREADS="2")
    apply_wait_policy(["serve", "aggregated"], child, is_torch_loaded=False, measure_idle=lambda: 2.0)
    assert WAIT_POLICY_VARIABLE not in child
    assert describe_wait_policy(child) == (
        "OpenMP wait policy libgomp's default (spin, then sleep) (2.0 CPUs idle at start-up for 2 threads)"
    )
    # A worker that takes turns on shared cores spins in them; a child of it chooses again.
    worker = dict(environ, OMP_NUM_THREADS="2")
    apply_wait_policy(["serve", "generation", "--shares-cores"], worker, is_torch_loaded=False)
    assert WAIT_POLICY_VARIABLE not in worker and worker[SPIN_COUNT_VARIABLE] == str(TURN_SPIN_COUNT)
    assert describe_wait_policy(worker) == (
        "OpenMP wait policy libgomp's default (spin, then sleep), GOMP_SPINCOUNT=300000 "
        "(--shares-cores: turns on the cores)"
    )
    apply_wait_policy(["serve", "aggregated"], worker, is_torch_loaded=False, measure_idle=lambda: 0.5)
    assert worker[WAIT_POLICY_VARIABLE] == "PASSIVE" and SPIN_COUNT_VARIABLE not in worker
    # The user's value is never replaced, whichever of the two variables it is.
    given = {WAIT_POLICY_VARIABLE: "ACTIVE"}
    assert apply_wait_policy(["serve", "context", "--shares-cores"], given, is_torch_loaded=False) is None
    assert given == {WAIT_POLICY_VARIABLE: "ACTIVE"}
    assert describe_wait_policy(given) == "OpenMP wait policy ACTIVE (from the environment)"
    spins = {SPIN_COUNT_VARIABLE: "500"}
    assert apply_wait_policy(["bench", "peers"], spins, is_torch_loaded=False) is None
    assert spins == {SPIN_COUNT_VARIABLE: "500"}
    # Too late once torch (and libgomp) is loaded: nothing is set that would not take effect.
    late: dict[str, str] = {}
    assert apply_wait_policy(["demo"], late, is_torch_loaded=True) is None and late == {}


def test_idle_cpus_is_a_fraction_of_this_hosts_cpus() -> None:
    idle = idle_cpus(0.05)
    assert 0.0 <= idle <= (os.cpu_count() or 1) + 1e-9


def test_command_line_chooses_it_before_torch_loads() -> None:
    assert run_probe(["status"], {}) == "PASSIVE None False"
    assert run_probe(["serve", "context", "--shares-cores"], {}) == "None 300000 False"
    assert run_probe(["status"], {WAIT_POLICY_VARIABLE: "ACTIVE"}) == "ACTIVE None False"
