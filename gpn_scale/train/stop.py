"""The stop signals of a training run, recorded from the moment `gpn-scale train` starts.

SIGTERM and SIGUSR1 (a launcher preempting the job) and SIGINT (Ctrl-C) ask the trainer to
checkpoint at the next step boundary and exit (75, or 130 for SIGINT); a second SIGINT interrupts
at once. They are recorded from the start of the command, before torch and DeepSpeed import, so
a trainer stopped while it is still starting up exits the same way, with a line, rather than dying
silently of the signal (143). The trainer acts on them collectively (`distributed.StopFlag`).
Standard library only: installed before the heavy imports.
"""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

_received = 0
_previous: dict | None = None  # the handlers before `record()`, restored by `restore()`


def _handler(signum, frame) -> None:
    global _received
    _received = signum
    if signum == signal.SIGINT:  # Ctrl-C twice: the second one interrupts at once
        signal.signal(signal.SIGINT, signal.default_int_handler)


def record() -> None:
    """Record the stop signals from now on (once; a second call keeps what was recorded)."""
    global _previous
    if _previous is not None:
        return
    _previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig in SIGNALS:
        signal.signal(sig, _handler)


def received() -> int:
    """The last stop signal received (0: none)."""
    return _received


def ignore() -> None:
    """Ignore further stop signals: launchers may repeat them, and one arriving while the
    interpreter shuts down (Python resets handlers to the default then, not ignored signals)
    would kill a run that already stopped cleanly."""
    global _previous
    _previous = {}
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def restore() -> None:
    """Give the handlers back as they were before `record()` (a command run in-process that ended
    before its trainer started); nothing once the trainer has ignored them at its end."""
    global _previous, _received
    if _previous:
        for sig, handler in _previous.items():
            signal.signal(sig, handler)
    _previous, _received = None, 0
