"""`beamsplit bench NAME`: runs a benchmark script from the repository's bench/ folder.

Each script exposes `add_arguments(parser)` and `run(arguments) -> int`; the scripts are not part of
the installed package (they need the checkout's bench/ folder), so they are loaded by path.
"""

from __future__ import annotations

import argparse
import importlib.util
import signal
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
BENCHMARKS = (
    ("transfer", "KV page pulls between two processes vs ucx_perftest and NIXL"),
    ("service", "disaggregated service vs aggregated server: bytes pulled and latency per beam width"),
    (
        "invariance",
        "the engine with and without batch-invariant kernels, side by side: prefill and decode step time",
    ),
    ("soak", "minutes of mixed traffic, a worker SIGKILLed and restarted every minute: lost, stranded, RSS"),
    (
        "peers",
        "beamsplit (aggregated and disaggregated, HTTP) against transformers, OpenVINO GenAI and CTranslate2 "
        "on SmolLM2-135M: one request alone, 16 at once, float32 and native bfloat16, host limits, goals",
    ),
    (
        "kv",
        "a sliding-window model (Gemma 3 270M) with window-aware KV groups against all-full: KV bytes held "
        "per request and moved per disaggregated request, prompts of 1k/4k/8k tokens",
    ),
    (
        "serve",
        "a replayed Poisson workload (beam widths 1/2/4) on a 156M random Llama: disaggregated, aggregated "
        "and transformers generate; throughput, TTFT, inter-token latency, KV memory, goals",
    ),
)


def load_bench_module(name: str) -> ModuleType:
    """bench/NAME.py, loaded by path once and registered in sys.modules as `bench_NAME` (bench/ must
    not go on sys.path, where bench/transfer.py would hide the `transfer` package; dataclasses look
    their module up in sys.modules). The benchmarks load their siblings with it too."""
    module_name = f"bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = BENCH_DIR / f"{name}.py"
    if not path.exists():
        raise SystemExit(f"benchmark script {path} not found: run from a checkout of the repository")
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _runner(name: str) -> object:
    def run(arguments: argparse.Namespace) -> int:
        # SIGTERM unwinds like Ctrl-C, through each benchmark's `finally` that stops its servers
        # by pid; the default action would kill this process and orphan them.
        def on_sigterm(signum: int, frame: object) -> None:
            raise SystemExit(143)

        previous = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            return int(load_bench_module(name).run(arguments))
        finally:
            signal.signal(signal.SIGTERM, previous)

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
        benchmark_parser.add_argument("--json", action="store_true", help="print only the JSON on stdout")
        if name == "serve":
            add_serve_arguments(benchmark_parser)
        elif name == "service":
            add_service_arguments(benchmark_parser)
        elif name == "peers":
            benchmark_parser.add_argument(
                "--quick", action="store_true", help="a tiny random model, short requests, no peer install"
            )
            benchmark_parser.add_argument(
                "--threads", type=int, default=0, help="threads for every system (default: the usable cores)"
            )
            benchmark_parser.add_argument(
                "--cache-dir",
                default="",
                help="where the checkpoint, the conversions and the peers' venv are built once "
                "(default: bench/out/peers-cache)",
            )
        elif name == "kv":
            add_kv_arguments(benchmark_parser)
        elif name == "soak":
            benchmark_parser.add_argument("--minutes", type=float, default=10.0, help="how long traffic runs")
            benchmark_parser.add_argument("--concurrency", type=int, default=16, help="client threads")
        else:
            benchmark_parser.add_argument("--quick", action="store_true", help="fewer cases, smaller pools")
            if name == "invariance":
                benchmark_parser.add_argument("--repeats", type=int, default=3, help="runs per setting")
        benchmark_parser.set_defaults(handler=_runner(name))


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    """`bench kv`'s flags beyond --json (bench/kv.py uses this too)."""
    parser.add_argument(
        "--model", default="gemma3-270m", help="a sliding-window model (default: gemma3-270m)"
    )
    parser.add_argument(
        "--prompt-lens", type=int, nargs="+", default=[1024, 4096, 8192], metavar="N",
        help="prompt lengths in tokens (default: 1024 4096 8192)",
    )  # fmt: skip
    parser.add_argument(
        "--beam-widths", type=int, nargs="+", default=[1, 4], metavar="W",
        help="beam widths of the moved-bytes cases; the held cases use the largest (default: 1 4)",
    )  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=4, help="new tokens per beam (default: 4)")
    parser.add_argument(
        "--kv-cache-gib", type=float, default=1.0, help="each engine's KV pool budget (default: 1 GiB)"
    )
    parser.add_argument("--skip-moved", action="store_true", help="held bytes only: start no servers")
    parser.add_argument(
        "--admitted-only", action="store_true",
        help="only the requests one engine admits at once per layout (no held or moved cases)",
    )  # fmt: skip
    parser.add_argument(
        "--out-dir", type=Path, default=Path(BENCH_DIR) / "out", help="where kv.json and kv.png go"
    )
    parser.add_argument(
        "--quick", action="store_true",
        help="a random 6-layer Gemma 3 (window 16, block 16) and prompts of 64 and 160 tokens, for the tests",
    )  # fmt: skip


def add_service_arguments(parser: argparse.ArgumentParser) -> None:
    """`bench service`'s flags beyond --json (bench/service.py uses this too)."""
    parser.add_argument("--quick", action="store_true", help="64-token prompts only, 2 repeats")
    parser.add_argument(
        "--shared-cores",
        action="store_true",
        help="start the workers with --shares-cores, as the one-host launcher does (default: the "
        "layout of a worker alone on its cores; requests go one at a time)",
    )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """`bench serve`'s flags beyond --json (bench/serve.py uses this too). Unset sizes take the
    full run's values, or --quick's; bench/serve.py holds both sets and prints them in its JSON."""
    parser.add_argument(
        "--quick", action="store_true", help="a tiny run: 6 requests, prompts of 32-256 tokens, 8 new tokens"
    )
    parser.add_argument("--num-requests", type=int, help="requests in the workload (default: 20; --quick: 6)")
    parser.add_argument("--rate", type=float, help="Poisson arrivals per second (default: 0.5; --quick: 2.0)")
    parser.add_argument(
        "--min-prompt-len", type=int, help="shortest prompt, tokens (default: 128; --quick: 32)"
    )
    parser.add_argument(
        "--max-prompt-len",
        type=int,
        help="longest prompt, also the TTFT-alone probe's (default: 4096; --quick: 256)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, help="new tokens per request and beam (default: 32; --quick: 8)"
    )
    parser.add_argument(
        "--itl-new-tokens",
        type=int,
        help="new tokens of the single greedy request (default: 64; --quick: 16)",
    )
    parser.add_argument(
        "--beam-widths", type=int, nargs="+", default=[1, 2, 4], help="in turn (default: 1 2 4)"
    )
    parser.add_argument(
        "--prefix-share", type=float, default=0.5, help="share of prompts with a shared prefix"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument(
        "--model", default="llama-156m", help="random model preset: llama-156m or llama-small"
    )
    parser.add_argument("--model-dir", help="checkpoint cache (default: ~/.cache/beamsplit/bench-models)")
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        default=1.0,
        help="each server's KV pool bound; the pool is at most 2048 blocks (default: 1.0, which is 2048 "
        "blocks of 512 KiB on llama-156m)",
    )
    parser.add_argument("--out-dir", help="where the PNGs go (default: bench/out)")
