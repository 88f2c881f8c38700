"""The help formatter of every subcommand: flags show their default when it says something."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help, except for None, False, flags with no help and help
    that states its default itself (argparse's BooleanOptionalAction appends one of its own too)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        is_meaningful = not (
            action.default is None or action.default is False or action.default == argparse.SUPPRESS
        )
        states_default = "%(default)" in help_text or "(default:" in help_text
        if action.option_strings and is_meaningful and not states_default:
            help_text += " (default: %(default)s)"
        return help_text
