"""The `beamsplit` command line: one subcommand per job, each in its own module of this package.

Modules are imported only when their subcommand runs, so `beamsplit --help` stays fast and a
missing optional dependency only affects the command that needs it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    import beamsplit.cli.generate as generate_args
    from beamsplit.cli.help_format import DefaultsHelpFormatter

    parser = subparsers.add_parser(
        "generate",
        help="generate beams for one prompt, in-process or against a running server (--target)",
        description="Generate beams for one prompt. Without --target the engine runs in this process; "
        "with --target HOST:PORT the request goes to a coordinator or aggregated server.",
        formatter_class=DefaultsHelpFormatter,
    )
    generate_args.add_arguments(parser)
    parser.set_defaults(handler=generate_args.run)


def _add_optional(subparsers: argparse._SubParsersAction, module_name: str) -> None:
    """Subcommands whose module registers its own parser (`register(subparsers)`)."""
    import importlib

    try:
        module = importlib.import_module(f"beamsplit.cli.{module_name}")
    except ModuleNotFoundError as error:
        if error.name != f"beamsplit.cli.{module_name}":
            raise
        return
    module.register(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="beamsplit",
        description="Disaggregated LLM inference with exact beam search.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    _add_generate(subparsers)
    for module_name in ("serve", "demo", "bench", "status", "model"):
        _add_optional(subparsers, module_name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import os

    from beamsplit.cli.config_file import parse_args_with_config
    from beamsplit.cli.thread_wait import apply_wait_policy

    arguments = sys.argv[1:] if argv is None else list(argv)
    # Before anything imports torch: OpenMP threads sleep at barriers where the cores are shared,
    # spin briefly where they are this server's own (beamsplit/cli/thread_wait.py; an
    # OMP_WAIT_POLICY the user set wins).
    apply_wait_policy(arguments, os.environ, "torch" in sys.modules)

    parser = build_parser()
    args = parse_args_with_config(parser, arguments)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
