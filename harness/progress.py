"""Progress of ``harness time`` on stderr: a bar on a terminal, a line per prompt elsewhere."""
from __future__ import annotations

import sys
import time

import click

from core.clirun import Pace


class Progress:
    """Per leg, a bar on a terminal; elsewhere (a pipe, a log file) one complete line per prompt."""

    def __init__(self, prompts: int, legs: int, clock=time.monotonic):
        self.prompts, self.legs, self.done = prompts, legs, 0
        self.pace = Pace(prompts, clock)
        self.bar = None
        if sys.stderr.isatty():
            self.bar = click.progressbar(length=prompts * 2 * legs, label="legs", file=sys.stderr, show_pos=True,
                                         item_show_func=lambda s: s)

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)
        return False

    def leg(self, prompt_id: str, rec: dict) -> None:
        if self.bar is not None:
            self.bar.update(1, f"{prompt_id} {rec['role']} {rec['leg'] + 1}/{self.legs}")

    def prompt_done(self, prompt_id: str, ratio: float) -> None:
        self.done += 1
        if self.bar is None:
            click.echo(f"{prompt_id}: {self.done}/{self.prompts} prompts, ratio {ratio:.3f}{self.pace(self.done)}",
                       err=True)


# --------------------------------------------------------------------------- under torchrun
