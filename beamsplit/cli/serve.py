"""`beamsplit serve aggregated|context|generation|coordinator`: one long-running server per process.

Each role's wiring lives in its own package and is imported only when that role starts.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Mapping
from types import MappingProxyType

from beamsplit.cli import server_args
from beamsplit.cli.help_format import DefaultsHelpFormatter
from beamsplit.cli.thread_wait import TURN_SPIN_COUNT

# role: (module with run(args), default port, its own flags, help)
ROLES: Mapping[str, tuple[str, int, Callable[[argparse.ArgumentParser], None] | None, str]] = (
    MappingProxyType(
        {
            "aggregated": (
                "beamsplit.server.aggregated_server",
                50050,
                server_args.add_aggregated_arguments,
                "the client API on one engine (the reference)",
            ),
            "context": (
                "context_worker.server",
                50051,
                server_args.add_context_arguments,
                "prefill prompts and hold their pages for pulls",
            ),
            "generation": (
                "generation_worker.server",
                50052,
                server_args.add_generation_arguments,
                "pull prompt pages, expand to W beams, decode",
            ),
            "coordinator": (
                "coordinator.server",
                50050,
                server_args.add_coordinator_arguments,
                "the client-facing front door over the workers",
            ),
        }
    )
)

# The choice beamsplit.cli.main makes (beamsplit/cli/thread_wait.py), told where a user looks for
# what to change.
WAIT_POLICY_NOTE = (
    "torch's OpenMP threads: when the host's CPUs are busy as the server starts, they sleep at "
    "barriers (OMP_WAIT_POLICY=PASSIVE; spinning measured up to 60 times slower on shared cores); "
    f"with --shares-cores they spin (GOMP_SPINCOUNT={TURN_SPIN_COUNT}, ~3 ms), since the worker computes "
    "alone in its turns; otherwise libgomp's default (spin, then sleep) saves a wake-up per parallel region. "
    "The start-up log says which; OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment wins "
    "(docs/service.md)"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="run a server: aggregated, context, generation or coordinator"
    )
    roles = parser.add_subparsers(dest="role", metavar="ROLE")
    roles.required = True
    for role, (module_name, default_port, add_role_arguments, help_text) in ROLES.items():
        role_parser = roles.add_parser(
            role,
            help=help_text,
            description=f"beamsplit serve {role}: {help_text}.",
            epilog=WAIT_POLICY_NOTE,
            formatter_class=DefaultsHelpFormatter,
        )
        role_parser.add_argument(
            "--config",
            metavar="FILE",
            default=None,
            help="TOML file with the same settings as these flags (keys like num_blocks; shared "
            "top-level keys and a [ROLE] table); flags given here override it",
        )
        server_args.add_server_arguments(role_parser, default_port)
        if role != "coordinator":
            server_args.add_engine_arguments(role_parser)
        if add_role_arguments is not None:
            add_role_arguments(role_parser)
        role_parser.set_defaults(handler=_runner(module_name))


def _runner(module_name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from beamsplit.cli.security_args import AuthConfigError
        from beamsplit.server.tls import TlsConfigError
        from beamsplit.server.worker_setup import ModelLoadError

        device_error = _device_error(getattr(args, "device", None))
        if device_error is not None:
            print(f"[{args.role}] error: {device_error}", file=sys.stderr)
            return 2
        try:
            return int(importlib.import_module(module_name).run(args))
        except (ModelLoadError, TlsConfigError, AuthConfigError) as error:  # one line: a bad file or flag
            print(f"[{args.role}] error: {error}", file=sys.stderr)
            return 2

    return run


def _device_error(device: str | None) -> str | None:
    """Why `--device` cannot be used on this host, in one line (None when it can, or has no engine)."""
    if device is None:
        return None
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        return f"--device {device}: not a torch device (expected cpu, cuda or cuda:N)"
    if parsed.type == "cpu":
        return None
    if parsed.type != "cuda":
        return f"--device {device}: only cpu and cuda devices are supported"
    if not torch.cuda.is_available():
        reason = "torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        return f"--device {device}: CUDA is not available on this host ({reason}); use --device cpu"
    num_devices = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= num_devices:
        return (
            f"--device {device}: this host has {num_devices} visible CUDA device(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )
    return None
