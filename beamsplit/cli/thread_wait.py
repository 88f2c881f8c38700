"""OpenMP's wait policy for every process the command line starts, chosen before torch loads libgomp.

torch's CPU kernels run in OpenMP parallel regions; libgomp's idle threads spin for a while at each
region's end barrier before they sleep (its default), or sleep at once (`OMP_WAIT_POLICY=PASSIVE`).
Which is faster depends on who else computes on the cores:
- cores shared with other busy processes (a context and a generation worker on one host, other
  jobs): a spinning thread burns the time slice its sibling needs to reach the barrier, and every
  region waits a scheduler tick. Measured on a 2-core Xeon at load average 5, SmolLM2-135M in
  float32, 2 threads, a 256-token prompt and 8 beam-4 steps: 3 to 36 s spinning, 1.1 to 1.9 s
  sleeping; the aggregated server's greedy inter-token gap 1.68 s against 0.12 s.
- cores this process has to itself: sleeping costs a wake-up per region (docs/benchmarks.md: the
  same host idle, 32 beam-4 steps: 2.48 s spinning against 2.93 s sleeping).
So an engine server (`serve aggregated|context|generation`, `generate`) keeps libgomp's default
where its cores are its own: the host's CPUs were idle enough for its threads when it started
(sampled from /proc/stat); otherwise PASSIVE. An engine server told --shares-cores takes turns on
the cores with the other engine processes (beamsplit/server/core_lease.py): it computes alone while it holds its turn,
so its threads spin for libgomp's default count, set explicitly (TURN_SPIN_COUNT rounds, ~3 ms):
sleeping at once there made a greedy decode step 1.5x slower and a lone beam-4 request 1.2-1.4x
slower on a 2-core VM, and a brief spin (10,000 rounds, until stop 39) left the generation
worker's many short regions of a step waking its threads: 16 beam-4 requests at once 154-159 beam
tokens/s against 181-195 (docs/service.md). The turn ends with the step; the other worker's step
then loses at most the spin's few milliseconds of one core. Other commands
(launchers, benchmarks, status) set PASSIVE for themselves. A value the user put in the
environment (either variable) is always kept. A value chosen here carries CHOICE_VARIABLE beside
it (the reason), so that a server a beamsplit command starts chooses again for itself instead of
inheriting it.

libgomp reads the variable once, when torch's import loads it, so this runs before any import of
torch (`beamsplit.cli.main`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, MutableMapping, Sequence

WAIT_POLICY_VARIABLE = "OMP_WAIT_POLICY"
CHOICE_VARIABLE = "BEAMSPLIT_OMP_WAIT_CHOICE"  # why beamsplit chose the policy (absent: the user's)
SPIN_COUNT_VARIABLE = "GOMP_SPINCOUNT"  # rounds a waiting thread spins before it sleeps
PASSIVE = "PASSIVE"
TURN_SPIN = "spin in turns"  # no OMP_WAIT_POLICY, GOMP_SPINCOUNT=TURN_SPIN_COUNT
TURN_SPIN_COUNT = 300000  # libgomp's default; it counts ~100,000 rounds a millisecond
ENGINE_COMMANDS = (("serve", "aggregated"), ("serve", "context"), ("serve", "generation"), ("generate",))
IDLE_SAMPLE_S = 0.2
# A CPU counts as free for a thread when the host's idle CPUs, sampled over IDLE_SAMPLE_S, reach
# the thread count less this slack (the sample itself and short blips).
IDLE_SLACK_CPUS = 0.5


def idle_cpus(sample_s: float = IDLE_SAMPLE_S) -> float:
    """The host's idle CPUs, averaged over sample_s (/proc/stat's idle + iowait); the CPU count
    where /proc/stat cannot be read (no evidence of other work)."""

    def times() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            values = [int(value) for value in stat.readline().split()[1:]]
        return values[3] + values[4], sum(values[:8])  # idle + iowait, all but guest time

    try:
        idle_before, total_before = times()
        time.sleep(sample_s)
        idle_after, total_after = times()
    except (OSError, ValueError, IndexError):
        return float(os.cpu_count() or 1)
    elapsed = total_after - total_before
    return (os.cpu_count() or 1) * (idle_after - idle_before) / elapsed if elapsed > 0 else 0.0


def engine_threads(environ: MutableMapping[str, str]) -> int:
    """The OpenMP threads torch will use: OMP_NUM_THREADS, else the usable CPUs."""
    usable = len(os.sched_getaffinity(0))
    try:
        return max(1, min(usable, int(environ.get("OMP_NUM_THREADS", usable))))
    except ValueError:
        return usable


def choose_wait_policy(
    argv: Sequence[str], environ: MutableMapping[str, str], measure_idle: Callable[[], float] = idle_cpus
) -> tuple[str | None, str]:
    """(policy, why): PASSIVE, TURN_SPIN, or None for libgomp's default (spin, then sleep)."""
    words = [word for word in argv if not word.startswith("-")]
    if not any(tuple(words[: len(command)]) == command for command in ENGINE_COMMANDS):
        return PASSIVE, "not an engine server"
    if "--shares-cores" in argv:
        return TURN_SPIN, "--shares-cores: turns on the cores"
    threads, idle = engine_threads(environ), measure_idle()
    if idle < threads - IDLE_SLACK_CPUS:
        return PASSIVE, f"{idle:.1f} CPUs idle at start-up for {threads} threads"
    return None, f"{idle:.1f} CPUs idle at start-up for {threads} threads"


def apply_wait_policy(
    argv: Sequence[str],
    environ: MutableMapping[str, str],
    is_torch_loaded: bool,
    measure_idle: Callable[[], float] = idle_cpus,
) -> str | None:
    """Chooses the policy for this process into `environ` unless the user set OMP_WAIT_POLICY or
    GOMP_SPINCOUNT or torch (and so libgomp) is loaded already, when it would change nothing;
    returns the reason recorded, else None."""
    users = WAIT_POLICY_VARIABLE in environ or SPIN_COUNT_VARIABLE in environ
    if is_torch_loaded or (users and CHOICE_VARIABLE not in environ):
        return None
    policy, why = choose_wait_policy(argv, environ, measure_idle)
    environ.pop(WAIT_POLICY_VARIABLE, None)
    environ.pop(SPIN_COUNT_VARIABLE, None)
    if policy == TURN_SPIN:
        environ[SPIN_COUNT_VARIABLE] = str(TURN_SPIN_COUNT)
    elif policy is not None:
        environ[WAIT_POLICY_VARIABLE] = policy
    environ[CHOICE_VARIABLE] = why
    return why


def describe_wait_policy(environ: MutableMapping[str, str]) -> str:
    """One line for a server's start-up log: the policy in force and who chose it."""
    policy = environ.get(WAIT_POLICY_VARIABLE) or "libgomp's default (spin, then sleep)"
    if SPIN_COUNT_VARIABLE in environ:
        policy += f", {SPIN_COUNT_VARIABLE}={environ[SPIN_COUNT_VARIABLE]}"
    who = "from the environment" if CHOICE_VARIABLE not in environ else environ[CHOICE_VARIABLE]
    return f"OpenMP wait policy {policy} ({who})"
