"""`beamsplit bench NAME`: runs a benchmark script from the repository's bench/ folder.

Each script exposes `add_arguments(parser)` and `run(arguments) -> int`; the scripts are not part of
the installed package (they need the checkout's bench/ folder), so they are loaded by path.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
BENCHMARKS = (
    ("transfer", "KV page pulls between two processes vs ucx_perftest and NIXL"),
    ("service", "disaggregated service vs aggregated server: bytes pulled and latency per beam width"),
    ("soak", "minutes of mixed traffic, a worker SIGKILLed and restarted every minute: lost, stranded, RSS"),
)


def _load(name: str) -> ModuleType:
    path = BENCH_DIR / f"{name}.py"
    if not path.exists():
        raise SystemExit(f"benchmark script {path} not found: run from a checkout of the repository")
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runner(name: str) -> object:
    def run(arguments: argparse.Namespace) -> int:
        return int(_load(name).run(arguments))

    return run


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="run a benchmark (prints JSON, draws a plot under bench/out/)"
    )
    benchmarks = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    benchmarks.required = True
    for name, description in BENCHMARKS:
        benchmark_parser = benchmarks.add_parser(name, help=description, description=description)
        # Same flags as the script's own command line; defined here so `--help` needs no import.
        benchmark_parser.add_argument("--json", action="store_true", help="print only the JSON list")
        if name == "soak":
            benchmark_parser.add_argument("--minutes", type=float, default=10.0, help="how long traffic runs")
            benchmark_parser.add_argument("--concurrency", type=int, default=16, help="client threads")
        else:
            benchmark_parser.add_argument("--quick", action="store_true", help="fewer cases, smaller pools")
        benchmark_parser.set_defaults(handler=_runner(name))
