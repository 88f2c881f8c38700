"""Per-shape kernel checks, measured once per process, or in a child process whose memory leaves with it.

The batch-invariant linear layers pick their kernel from checks (engine/onednn_calls.py,
engine/batch_invariant.py, engine/fused_projections.py) that multiply random banks of rows,
once per shape, dtype and thread count. What they leave behind in the process that ran them is
not small: oneDNN caches a primitive for every (shape, row count) a check called (the any-M check
alone tries 11 row counts; a bfloat16 primitive on the AMX host is a JIT kernel and its
scratchpad), and the banks' freed chunks stay in malloc's heap. Measured on SmolLM2-135M in
bfloat16 (issue 29): 38 MiB of the engine's resident memory after load (1652 against 1614 MiB),
more than the 9 MiB by which the aggregated server missed the bound of 1.3x its weights + pool.

So the engine can ask a child process to run them: `CheckChild` (started by the engine when the
loader reads the config) or `measure_in_child` (started on the spot) starts this module with
the same interpreter, torch build, environment and thread count; it runs the calls it is given (the
checks a model's warm-up will ask, in the warm-up's order) and hands the results back; the parent
adopts them, and its warm-up finds every answer known. The answers are facts about this torch
build on this CPU at that thread count, so the child measures what the parent would: oneDNN and
MKL pick their kernels from the ISA, the shape, the dtype and the threads, all the same there
(`ONEDNN_*` and `MKL_*` settings are inherited with the environment). The serving kernels'
own primitives are still created in the parent, by the warm-up's forward passes. A child that
fails or overruns its bound is ended and the parent runs the checks itself (logged): the same
answers, only the memory is lost.

Every check is a `KernelCheck`: a pure function of its arguments, its results kept per process by
(qualified name, arguments), with `cache_info().misses` counting those measured here.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, ParamSpec, TypeVar

import torch

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

CHILD_TIMEOUT_S = 600.0  # far above what the checks took here (SmolLM2-135M: 1.2-1.5 s in bfloat16)
# A child costs a Python start and `import torch` (1.3-1.5 s here): worth it only where the checks are large
# (their banks and primitives scale with the largest shape, the LM head's out x in).
CHILD_MIN_ELEMENTS = 1 << 20

# (qualified name of the check, its arguments) -> its result, measured here or adopted
_FACTS: dict[tuple[str, tuple[Any, ...]], Any] = {}


@dataclass(frozen=True)
class CheckInfo:
    misses: int  # results measured in this process since the last cache_clear


class KernelCheck(Generic[P, R]):
    """A kernel check whose results are kept per process (and may be adopted from a child)."""

    def __init__(self, function: Callable[P, R]) -> None:
        functools.update_wrapper(self, function)  # __module__, __qualname__, __doc__, __wrapped__
        self.__wrapped__ = function
        self.name = f"{function.__module__}.{function.__qualname__}"
        self._misses = 0

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if kwargs:
            raise TypeError(f"{self.name} takes positional arguments only (they key its results)")
        key = (self.name, args)
        if key not in _FACTS:
            _FACTS[key] = self.__wrapped__(*args, **kwargs)  # no kwargs: checked above
            self._misses += 1
        result: R = _FACTS[key]
        return result

    def cache_info(self) -> CheckInfo:
        return CheckInfo(self._misses)

    def cache_clear(self) -> None:
        for key in [key for key in _FACTS if key[0] == self.name]:
            del _FACTS[key]
        self._misses = 0


def kernel_check(function: Callable[P, R]) -> KernelCheck[P, R]:
    return KernelCheck(function)


def is_known(check: Callable[..., object], *args: Any) -> bool:
    """Has this process a result of `check` for `args` (False for what is no KernelCheck: a test's
    stand-in)?"""
    return isinstance(check, KernelCheck) and (check.name, args) in _FACTS


class CheckChild:
    """A child process for kernel checks, started early: its interpreter and imports (~1.5 s, most
    of it `import torch`) get ready while the parent loads the weights; `measure` asks it once,
    `close` ends it unasked. It exits by itself when its input closes (the parent gone)."""

    def __init__(self, modules: Sequence[str]) -> None:
        """modules: the engine modules whose checks the child will run, imported before it waits."""
        for module in modules:
            _check_engine_module(module)
        self.started = time.monotonic()
        self._process: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-m", "engine.kernel_facts", *modules],
            env=_child_environment(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    def measure(
        self,
        calls: Sequence[tuple[Callable[..., object], tuple[Any, ...]]],
        num_threads: int,
        timeout_s: float = CHILD_TIMEOUT_S,
    ) -> bool:
        """Runs `calls` ((a function of the engine package that asks kernel checks, its
        arguments), in order) in the child at `num_threads` torch threads and adopts every check
        result measured there; False (and nothing adopted) where the child failed or overran
        timeout_s, after ending it. A child is asked once."""
        for function, _ in calls:
            _check_engine_module(function.__module__)
        process, self._process = self._process, None
        if process is None:
            raise RuntimeError("this kernel-check child was asked already")
        request = pickle.dumps(
            (num_threads, [(function.__module__, function.__qualname__, args) for function, args in calls])
        )
        try:
            stdout, stderr = process.communicate(request, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            logger.warning("kernel checks in a child process overran %.0f s; running them here", timeout_s)
            return False
        if process.returncode != 0:
            tail = stderr.decode(errors="replace").strip().splitlines()[-3:]
            logger.warning(
                "kernel checks in a child process exited %d (%s); running them here",
                process.returncode,
                " | ".join(tail),
            )
            return False
        facts: dict[tuple[str, tuple[Any, ...]], Any] = pickle.loads(stdout)
        for key, value in facts.items():
            _FACTS.setdefault(key, value)
        logger.info(
            "kernel checks at %d threads: %d results measured in a child process, %.1f s after it started",
            num_threads, len(facts), time.monotonic() - self.started,
        )  # fmt: skip
        return True

    def close(self) -> None:
        """Ends the child if it was not asked (its input closed, it exits; killed after 10 s)."""
        process, self._process = self._process, None
        if process is None:
            return
        try:
            process.communicate(b"", timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


def measure_in_child(
    calls: Sequence[tuple[Callable[..., object], tuple[Any, ...]]],
    num_threads: int,
    timeout_s: float = CHILD_TIMEOUT_S,
) -> bool:
    """CheckChild.measure in a child started for it (see there)."""
    if not calls:
        return True
    modules = sorted({function.__module__ for function, _ in calls})
    try:
        child = CheckChild(modules)
    except OSError as error:
        logger.warning("kernel checks in a child process could not start (%s); running them here", error)
        return False
    try:
        return child.measure(calls, num_threads, timeout_s)
    finally:
        child.close()


def _check_engine_module(module: str) -> None:
    if not module.startswith("engine."):
        raise ValueError(f"a kernel-check child runs only the engine's checks, not {module}")


def _child_environment() -> dict[str, str]:
    """This process's environment (oneDNN's and MKL's settings with it), with the directory that
    holds this engine package first on the child's path: it imports the same code."""
    package_root = str(Path(__file__).resolve().parent.parent)
    paths = [package_root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def _child_main(modules: Sequence[str]) -> None:
    """The child: imports `modules`, then reads (threads, calls) from stdin (nothing: it exits),
    runs the calls, writes every check result measured here to stdout."""
    for module in modules:
        _check_engine_module(module)
        importlib.import_module(module)
    request = sys.stdin.buffer.read()
    if not request:
        return
    num_threads, calls = pickle.loads(request)
    torch.set_num_threads(num_threads)
    for module, qualname, args in calls:
        _check_engine_module(module)
        function: Any = importlib.import_module(module)
        for name in qualname.split("."):
            function = getattr(function, name)
        function(*args)
    sys.stdout.buffer.write(pickle.dumps(dict(_FACTS)))


if __name__ == "__main__":
    # Run as a script this file is __main__; the checks register with engine.kernel_facts.
    from engine.kernel_facts import _child_main as child_main

    child_main(sys.argv[1:])
