"""Command-line flags of `beamsplit serve`, kept free of heavy imports so `--help` stays fast."""

from __future__ import annotations

import argparse
from pathlib import Path

from beamsplit.cli import engine_args, security_args
from beamsplit.server.core_lease import default_lease_path


def add_server_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (gRPC, metrics and UCX)")
    group.add_argument("--port", type=int, default=default_port, help="gRPC port (0: any free port)")
    group.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: none)")
    group.add_argument(
        "--shutdown-grace-s", type=float, default=10.0, help="how long SIGTERM waits for in-flight requests"
    )
    group.add_argument(
        "--max-message-mb",
        type=float,
        default=4.0,
        help="largest gRPC request accepted; larger ones are refused with RESOURCE_EXHAUSTED",
    )
    security_args.add_server_tls_arguments(parser)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine flags of the offline `generate`, plus the batch bound and the engine's seed."""
    group = engine_args.add_engine_arguments(parser)
    group.add_argument("--max-num-seqs", type=int, default=64, help="beams across all running requests")
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="tokens one forward pass feeds: a token per decoding beam, then prompt chunks; a longer "
        "prompt is prefilled over several steps (default: 512, at least --max-num-seqs)",
    )
    group.add_argument("--seed", type=int, default=0, help="engine seed (sampling requests without one)")


def add_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV transfer (UCX)")
    group.add_argument(
        "--transfer-port", type=int, default=0, help="UCX control listener port on --host (0: any free port)"
    )
    group.add_argument(
        "--advertise-host",
        default=None,
        help="address peers use to reach this worker's UCX listener (default: --host; the host name "
        "when --host is a wildcard)",
    )
    group.add_argument(
        "--transfer-lanes",
        type=int,
        default=None,
        choices=range(1, 17),
        metavar="{1..16}",
        help="threads that receive one pull in parallel, each with its own UCX worker, one per 4 MiB "
        "pulled (default: 2, 1 on a single-core host); on one host the receiver does the copy, so "
        "lanes use more cores",
    )
    group.add_argument(
        "--transfer-watchdog-s",
        type=float,
        default=5.0,
        help="health turns NOT_SERVING when the transfer agent's event loop has not come round for "
        "this long (a wedged transfer layer), and SERVING again once it does",
    )


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_admission_arguments(parser: argparse.ArgumentParser) -> None:
    """The bounded queue of requests whose KV blocks do not fit yet (docs/service.md, Admission)."""
    group = parser.add_argument_group("admission queue")
    group.add_argument(
        "--max-queued-requests",
        type=_non_negative_int,
        default=64,
        help="requests that may wait for KV blocks (or batch room) at once; more are refused with "
        "RESOURCE_EXHAUSTED (HTTP 429) at once (0: refuse whatever does not fit now)",
    )
    group.add_argument(
        "--max-queue-wait-s",
        type=_positive_float,
        default=30.0,
        help="longest a request waits in that queue before it is refused with RESOURCE_EXHAUSTED",
    )


def add_aggregated_arguments(parser: argparse.ArgumentParser) -> None:
    add_http_arguments(parser)
    add_admission_arguments(parser)
    add_shares_cores_argument(parser)


def add_shares_cores_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shares-cores",
        action="store_true",
        help="other engine processes (the other worker of a one-host deployment, an aggregated "
        "server beside them) compute on this host's cores: take turns with them, one engine step "
        "at a time, through --core-lease-file (the one-host launcher sets it; docs/service.md)",
    )
    parser.add_argument(
        "--core-lease-file",
        type=Path,
        default=default_lease_path(),
        help="with --shares-cores: the lock file the processes sharing these cores take turns on "
        "(default: %(default)s; the one-host launcher gives each deployment its own)",
    )


def add_context_arguments(parser: argparse.ArgumentParser) -> None:
    add_transfer_arguments(parser)
    add_shares_cores_argument(parser)
    add_admission_arguments(parser)
    parser.add_argument(
        "--lease-s", type=float, default=30.0, help="how long pages stay pinned without a heartbeat"
    )


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    add_transfer_arguments(parser)
    add_shares_cores_argument(parser)
    parser.add_argument("--pull-timeout-s", type=float, default=30.0, help="bound on one prompt's pull")
    add_admission_arguments(parser)


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
        "--prefill-timeout-s",
        type=float,
        default=120.0,
        help="bound on one prompt's prefill on a context worker when the client sets no deadline "
        "(raise it for prompts of many thousand tokens on CPU)",
    )
    parser.add_argument(
        "--max-attempts", type=int, default=2, help="tries per request on unreachable workers"
    )
    parser.add_argument(
        "--prefix-affinity-slack",
        type=_non_negative_int,
        default=2,
        help="a worker whose prefix tree holds more of the prompt is preferred while its load is at "
        "most this many requests above the least loaded worker's (docs/service.md, Routing)",
    )
    add_http_arguments(parser)


def add_http_arguments(parser: argparse.ArgumentParser) -> None:
    """The OpenAI-compatible HTTP front of the client API (coordinator and aggregated server), and
    the bearer token both its fronts require."""
    security_args.add_auth_arguments(parser, is_server=True)
    parser.add_argument(
        "--http-port",
        type=int,
        default=0,
        help="OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models) on --host (0: none)",
    )
    parser.add_argument(
        "--http-max-body-mb",
        type=float,
        default=4.0,
        help="largest HTTP request body accepted; larger ones are refused with 413",
    )
