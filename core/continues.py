"""Counting the times a process is continued after a stop (SIGCONT).

A process stopped by SIGSTOP runs again only once something sends it SIGCONT, and a handler for
that signal runs each time. ``audit retime`` stops the side it is not timing and counts its own
continues; its workers (``harness.worker``) and the audit itself count the continues they receive.
A count above the audit's own means that another process stopped one of them: a leg's time then
holds a pause that is not the decoder's.
"""
from __future__ import annotations

import signal


class ContinueCounter:
    """Counts this process's SIGCONTs from ``install()`` to ``restore()`` (a no-op where the
    platform has no such signal). Interrupted system calls restart, so a continue changes nothing
    but the count."""

    def __init__(self):
        self.count = 0
        self._before = None

    def install(self) -> "ContinueCounter":
        if hasattr(signal, "SIGCONT"):
            self._before = signal.signal(signal.SIGCONT, self._continued)
            signal.siginterrupt(signal.SIGCONT, False)
        return self

    def restore(self) -> None:
        if hasattr(signal, "SIGCONT") and self._before is not None:
            signal.signal(signal.SIGCONT, self._before)
            self._before = None

    def _continued(self, signum, frame) -> None:
        self.count += 1
