"""The help formatter every `gpn-scale` subcommand's parser uses: each option's default is shown."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.HelpFormatter):
    """Appends `(default: X)` to an option's help, unless the help already states its default or
    there is none worth stating (None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"
