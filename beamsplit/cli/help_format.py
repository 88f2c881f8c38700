"""The help formatter of every subcommand: flags show their default when it says something."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help, except for None, False and flags with no help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        is_meaningful = not (
            action.default is None or action.default is False or action.default == argparse.SUPPRESS
        )
        if action.option_strings and is_meaningful and "%(default)" not in help_text:
            help_text += " (default: %(default)s)"
        return help_text
