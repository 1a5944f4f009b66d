"""What every `gpn-scale` subcommand shares in what it prints: the help formatter its parser uses
(each option's default is shown), and `json_stdout` for `--json`, whose JSON is alone on stdout so
that `gpn-scale eval ... --json | jq` works.

Libraries write to stdout while a command works: DeepSpeed's logger, for one, prints "Setting
accelerator to CPU ..." when it is imported on a machine without a GPU, through a handler that
keeps the stdout it was made with. `json_stdout()` sends all of that to stderr for the length of a
`with` block and hands the command the real stdout for its JSON. The standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import TextIO


class HelpFormatter(argparse.HelpFormatter):
    """Appends `(default: X)` to an option's help, unless the help already states its default or
    there is none worth stating (None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


@contextlib.contextmanager
def json_stdout(enabled: bool = True) -> Iterator[TextIO]:
    """Yields the stream for the command's JSON: the real stdout. While the block runs (when
    `enabled`), `sys.stdout` is stderr, so prints and loggers made in the block write there, and
    every logging handler that already writes to the real stdout is pointed at stderr, then back."""
    real = sys.stdout
    if not enabled:
        yield real
        return
    loggers = [logging.getLogger()] + [x for x in logging.Logger.manager.loggerDict.values()
                                       if isinstance(x, logging.Logger)]
    moved = [h for x in loggers for h in x.handlers
             if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is real]
    for handler in moved:
        handler.setStream(sys.stderr)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield real
    finally:
        for handler in moved:
            handler.setStream(real)
