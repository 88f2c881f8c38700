"""Command-line flags of `beamsplit serve`, kept free of heavy imports so `--help` stays fast."""

from __future__ import annotations

import argparse


def add_server_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (gRPC, metrics and UCX)")
    group.add_argument("--port", type=int, default=default_port, help="gRPC port (0: any free port)")
    group.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: none)")
    group.add_argument(
        "--shutdown-grace-s", type=float, default=10.0, help="how long SIGTERM waits for in-flight requests"
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine flags of the offline `generate`, for every server that owns an engine."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default="tiny", help="'tiny' or a local Hugging Face Llama directory")
    group.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16"))
    group.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    group.add_argument("--tokens-per-block", type=int, default=32, choices=(16, 32, 64, 128))
    group.add_argument("--num-blocks", type=int, default=2048, help="KV pool size in blocks")
    group.add_argument("--max-num-seqs", type=int, default=64, help="beams across all running requests")
    group.add_argument(
        "--enable-partial-reuse", action="store_true", help="reuse the leading part of a shared block"
    )
    group.add_argument(
        "--enable-partial-commit", action="store_true", help="publish non-full blocks (not with beam search)"
    )
    group.add_argument("--seed", type=int, default=0)


def add_context_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lease-s", type=float, default=30.0, help="how long pages stay pinned without a heartbeat"
    )


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pull-timeout-s", type=float, default=30.0, help="bound on one prompt's pull")


def add_coordinator_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", required=True, help="context workers, HOST:PORT[,HOST:PORT...]")
    parser.add_argument("--generation", required=True, help="generation workers, HOST:PORT[,HOST:PORT...]")
    parser.add_argument(
        "--model", default=None, help="tokenizer source (default: the model the workers report)"
    )
    parser.add_argument(
        "--wait-for-workers-s", type=float, default=60.0, help="bound on waiting for workers at start"
    )
    parser.add_argument("--lease-s", type=float, default=30.0, help="lease asked of context workers")
    parser.add_argument(
        "--max-attempts", type=int, default=2, help="tries per request on unreachable workers"
    )
