"""What `--help` says: every checkpoint family the loader takes, each default once."""

from __future__ import annotations

import argparse
import re

import pytest

from beamsplit.cli import build_parser
from beamsplit.cli.engine_args import FAMILY_NAMES
from engine.models.families import SUPPORTED_MODEL_TYPES


def subcommand_helps() -> dict[str, str]:
    """Each `serve ROLE`, `generate` and `bench NAME`'s help text, by command."""
    helps: dict[str, str] = {}

    def walk(parser: argparse.ArgumentParser, prefix: str) -> None:
        subparsers = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
        if not subparsers:
            helps[prefix] = parser.format_help()
        for action in subparsers:
            for name, child in action.choices.items():
                walk(child, f"{prefix} {name}".strip())

    walk(build_parser(), "")
    return helps


def test_model_help_names_every_family_the_loader_takes() -> None:
    assert set(FAMILY_NAMES) == set(SUPPORTED_MODEL_TYPES)
    text = " ".join(subcommand_helps()["serve aggregated"].split())
    for name in FAMILY_NAMES.values():
        assert name in text, name
    assert "'gemma3-270m'" in text and "'smollm2-135m'" in text


@pytest.mark.parametrize("command", ["serve aggregated", "serve context", "serve generation", "generate"])
def test_each_flag_states_its_default_once(command: str) -> None:
    text = " ".join(subcommand_helps()[command].split())
    # A flag's help ends in one "(default: X)" at most: never "(default: X) (default: X)"
    assert not re.search(r"\(default:[^()]*\) \(default:", text), command
    assert "(default: True)" in text  # --batch-invariant's, argparse's own
