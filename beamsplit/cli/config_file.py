"""`--config FILE`: a TOML file holding the same settings as a command's flags.

Keys are flag names without the dashes, spelled with dashes or underscores (`num-blocks` or
`num_blocks`). One file can describe a whole deployment: top-level keys are shared, and a table
named after a sibling subcommand (`[context]`, `[generation]`, `[coordinator]`, `[aggregated]`)
holds the settings of that one; its keys win over the shared ones.

    model = "/models/llama"          # every role that has --model
    dtype = "bfloat16"               # roles without --dtype (the coordinator) skip it
    [context]
    port = 50051
    [coordinator]
    context = "ctx-0:50051,ctx-1:50051"

Rules: a key in a role's table must be a flag of that role; a top-level key must be a flag of at
least one sibling (it applies to those that have it); a table that names no sibling is an error;
a value must have the flag's type (true/false for a switch, an integer for an integer flag, a
number for a float flag, a string otherwise) and be one of its choices. Values become the
parser's defaults, so a flag on the command line overrides the file, and a required flag the file
provides is no longer required.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CONFIG_FLAG = "--config"
_NOT_SETTINGS = frozenset({"help", "config"})


class ConfigFileError(ValueError):
    """The file cannot be read, or one of its keys or values is wrong; the message names both."""


def parse_args_with_config(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)`, with the defaults of the chosen subcommand taken from `--config`.

    Only a subcommand that defines `--config` reads it. A bad file exits 2 through argparse's
    own error, one line naming the file and the key.
    """
    leaf, siblings, name = _chosen_subcommand(parser, argv)
    path = _flag_value(argv, CONFIG_FLAG)
    if path is not None and CONFIG_FLAG in leaf._option_string_actions:
        try:
            settings = load_settings(Path(path), name, leaf, siblings)
        except ConfigFileError as error:
            leaf.error(str(error))
        apply_defaults(leaf, settings)
    return parser.parse_args(argv)


def load_settings(
    path: Path,
    name: str,
    parser: argparse.ArgumentParser,
    siblings: Mapping[str, argparse.ArgumentParser],
) -> dict[str, Any]:
    """The settings `path` gives subcommand `name`, keyed by argparse dest, values checked."""
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigFileError(f"cannot read config file {path}: {error.strerror or error}") from error
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigFileError(f"config file {path} is not valid TOML: {error}") from error

    shared: dict[str, Any] = {}
    for key, value in document.items():
        if isinstance(value, dict):
            if key not in siblings:
                raise ConfigFileError(
                    f"config file {path}: unknown table [{key}] (expected one of: {', '.join(siblings)})"
                )
            continue
        if not any(_action_for(sibling, key) is not None for sibling in siblings.values()):
            raise ConfigFileError(f"config file {path}: unknown key '{key}' (no such flag --{_flag(key)})")
        shared[key] = value
    own = document.get(name, {})

    settings: dict[str, Any] = {}
    for key, value in shared.items():
        action = _action_for(parser, key)
        if action is not None:  # a shared key for other roles only
            settings[action.dest] = _checked_value(path, key, value, action)
    for key, value in own.items():
        action = _action_for(parser, key)
        if action is None:
            raise ConfigFileError(
                f"config file {path}: unknown key '{key}' in [{name}] (beamsplit has no --{_flag(key)} there)"
            )
        settings[action.dest] = _checked_value(path, f"{name}.{key}", value, action)
    return settings


def apply_defaults(parser: argparse.ArgumentParser, settings: Mapping[str, Any]) -> None:
    """The file's values as defaults; a required flag with a value from the file is optional."""
    parser.set_defaults(**settings)
    for action in parser._actions:
        if action.dest in settings:
            action.required = False


def _chosen_subcommand(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser], str]:
    """Walks the subcommand words of `argv` down to the innermost parser they name."""
    leaf, siblings, name = parser, {"": parser}, ""
    for token in argv:
        if token == "--":
            break
        choices = _subcommands(leaf)
        if token in choices:
            leaf, siblings, name = choices[token], choices, token
    return leaf, siblings, name


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` in `argv` (argparse's rule: last wins)."""
    value = None
    for index, token in enumerate(argv):
        if token == "--":
            break
        if token == flag and index + 1 < len(argv):
            value = argv[index + 1]
        elif token.startswith(flag + "="):
            value = token[len(flag) + 1 :]
    return value


def _flag(key: str) -> str:
    return key.replace("_", "-")


def _action_for(parser: argparse.ArgumentParser, key: str) -> argparse.Action | None:
    action = parser._option_string_actions.get(f"--{_flag(key)}")
    if action is None or action.dest in _NOT_SETTINGS or action.dest == argparse.SUPPRESS:
        return None
    return action


def _checked_value(path: Path, key: str, value: Any, action: argparse.Action) -> Any:
    def wrong(expected: str) -> ConfigFileError:
        return ConfigFileError(
            f"config file {path}: '{key}' must be {expected}, got {value!r} ({type(value).__name__})"
        )

    if isinstance(
        action, argparse._StoreTrueAction | argparse._StoreFalseAction | argparse.BooleanOptionalAction
    ):
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if action.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an integer")
    elif action.type is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise wrong("a number")
        value = float(value)
    elif action.type is None:
        if not isinstance(value, str):
            raise wrong("a string")
    else:  # a custom converter: give it the text it would get on the command line
        if isinstance(value, dict | list):
            raise wrong("a single value")
        try:
            value = action.type(str(value))  # type: ignore[operator]
        except (TypeError, ValueError, argparse.ArgumentTypeError) as error:
            raise wrong(f"a valid value ({error})") from error
    if action.choices is not None and value not in action.choices:
        choices = action.metavar if isinstance(action.metavar, str) else ", ".join(map(repr, action.choices))
        raise wrong(f"one of {choices}")
    return value
