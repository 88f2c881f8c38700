"""OpenMP's wait policy for every process the command line starts, set before torch loads libgomp.

torch's CPU kernels run in OpenMP parallel regions; by default libgomp's idle threads spin at
each region's end barrier before they sleep. On cores shared with other busy processes (the
2-core hosts these benchmarks run on, a context and a generation worker on one host) a spinning
thread burns the time slice its sibling needs to reach the barrier, and every region then waits a
scheduler tick: measured on a 2-core Xeon at load average 5 (other jobs running), SmolLM2-135M
in float32, 2 threads, a 256-token prompt and 8 beam-4 steps took 3 to 36 s spinning and 1.1 to
1.9 s with OMP_WAIT_POLICY=PASSIVE (1 thread: 1.2 to 2.8 s); the aggregated server's greedy
inter-token gap went from 1.68 s to 0.12 s. On an idle host spinning is faster by a
wake-up per region (the same request took 0.77 s spinning at load 1), so a user who owns the cores
sets OMP_WAIT_POLICY=ACTIVE (or any value): a value already in the environment is kept.

libgomp reads the variable once, when torch's import loads it, so this runs before any import of
torch (`beamsplit.cli.main`); child processes inherit it through the environment.
"""

from __future__ import annotations

from collections.abc import MutableMapping

WAIT_POLICY_VARIABLE = "OMP_WAIT_POLICY"
DEFAULT_WAIT_POLICY = "PASSIVE"


def apply_default_wait_policy(environ: MutableMapping[str, str], is_torch_loaded: bool) -> str | None:
    """Sets OMP_WAIT_POLICY to PASSIVE in `environ` unless it is set already or torch (and so
    libgomp) is loaded, when setting it would change nothing; returns the value set, else None."""
    if is_torch_loaded or WAIT_POLICY_VARIABLE in environ:
        return None
    environ[WAIT_POLICY_VARIABLE] = DEFAULT_WAIT_POLICY
    return DEFAULT_WAIT_POLICY
