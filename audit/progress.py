"""Progress with an ETA for the long audit commands (``audit replay``, ``audit tokens``): a tqdm bar
on stderr over the positions the pristine walk computes.

The total is an estimate made before the walk (``audit.replay.planned_positions``: per prompt,
its longest stream plus one, at most N); a walk that stops early (every stream has diverged, or
an EOS) takes its unwalked positions off the total, so the ETA shrinks rather than the bar
stopping short. The bar shows only on a
terminal (tqdm's ``disable=None``): a log or a pipe gets the per-prompt lines alone, each with the
time left at the pace so far; they go through ``tqdm.write`` while the bar is up so the two never
interleave.
"""
from __future__ import annotations

import sys
import time

from tqdm import tqdm

from core.clirun import Pace
from audit.report import printable


class Progress:
    """A bar over ``total`` positions, and the log lines printed beside it."""

    def __init__(self, total: int, desc: str, log=None, enabled: bool | None = None, file=None,
                 clock=time.monotonic):
        self.log_fn = log
        self.bar = tqdm(total=total, desc=desc, unit="tok", file=file or sys.stderr, dynamic_ncols=True,
                        disable=None if enabled is None else not enabled, leave=False)
        # counted here too: a disabled bar (no terminal) counts nothing, and its lines say the time left
        self.done, self.pace = 0, Pace(total, clock)

    def tick(self, n: int = 1) -> None:
        self.done += n
        self.bar.update(n)

    def settle(self, estimated: int, walked: int, ticked: int) -> None:
        """One prompt's walk is over: count what was walked but not ticked, drop what was estimated
        but not walked from the total."""
        if walked > ticked:
            self.done += walked - ticked
            self.bar.update(walked - ticked)
        if estimated != walked:
            self.pace.total = max(self.done, self.pace.total - estimated + walked)
            self.bar.total = max(self.bar.n, self.bar.total - estimated + walked)
            self.bar.refresh()

    def time_left(self) -> str:
        return "; " + self.pace.phrase(self.done) if self.done or self.done >= self.pace.total else ""

    def log(self, message: str) -> None:
        if self.bar.disable:
            if self.log_fn:
                self.log_fn(message + self.time_left())
        else:
            tqdm.write(printable(message), file=self.bar.fp)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
