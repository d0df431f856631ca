"""Runs a click command as a plain function: the callback's return value comes back (tests and
``main(argv)`` callers use it), and bad usage is one ``error:`` line with exit status 2."""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import click
from click.exceptions import NoArgsIsHelpError

from core.errors import EXIT_INTERRUPTED

EXIT_USAGE = 2


def run_command(command: click.Command, argv: list[str] | None, prog_name: str):
    """``command``'s callback result for ``argv`` (None: sys.argv), or, where click ended the
    command itself, an exit status: 0 after ``--help`` or ``--version``; 2 after a usage error (a
    missing or malformed option), printed as one ``error: ...`` line naming ``--help``; 2 after
    the group's help for a group called without a command."""
    try:
        return command.main(args=argv, prog_name=prog_name, standalone_mode=False)
    except NoArgsIsHelpError as exc:
        click.echo(exc.format_message(), err=True)
        return EXIT_USAGE
    except click.UsageError as exc:
        path = exc.ctx.command_path if exc.ctx is not None else prog_name
        click.echo(f"error: {one_line(exc.format_message())} (see {path} --help)", err=True)
        return EXIT_USAGE
    except click.ClickException as exc:
        click.echo(f"error: {one_line(exc.format_message())}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:  # Ctrl-C while click itself was running (a prompt)
        click.echo("error: interrupted; nothing was written", err=True)
        return EXIT_INTERRUPTED


def one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


class UsageLine(click.ClickException):
    """A usage error shown as the one ``error:`` line ``run_command`` prints, where click itself
    runs the command (standalone mode: console scripts, ``python -m``, ``CliRunner``)."""

    exit_code = EXIT_USAGE

    def __init__(self, exc: click.UsageError, prog_name: str):
        super().__init__(one_line(exc.format_message()))
        self.path = exc.ctx.command_path if exc.ctx is not None else prog_name

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()} (see {self.path} --help)", file=file, err=file is None)


class Interrupted(click.ClickException):
    """A Ctrl-C that the command did not answer itself (one that came while it imported its code,
    say): one ``error: interrupted`` line and exit 130, where click would print "Aborted!" and exit 1."""

    exit_code = EXIT_INTERRUPTED

    def __init__(self):
        super().__init__("interrupted")

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", file=file, err=file is None)


class OneLineUsageGroup(click.Group):
    """A command group whose commands' usage errors (a value out of range, an unknown option, a
    missing argument) are one ``error:`` line and exit 2, as every other mistake is, and whose
    unanswered Ctrl-C is one line and exit 130 (``Interrupted``)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except NoArgsIsHelpError:
            raise
        except click.UsageError as exc:
            raise UsageLine(exc, ctx.command_path) from None
        except KeyboardInterrupt:
            raise Interrupted() from None


class IntRange(click.IntRange):
    """A ``click.IntRange`` that calls a value it cannot read "not a valid integer" (click's own
    words name its type, "integer range") and shows INTEGER in ``--help``, its bounds beside it."""

    name = "integer"


class FiniteFloat(click.FloatRange):
    """A ``click.FloatRange`` that also refuses nan and inf, which pass its bounds (every comparison
    with nan is false) and would only fail when the document is written, after the work. A value it
    cannot read is "not a valid number"."""

    name = "number"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class PathArg(click.Path):
    """A ``click.Path`` giving a ``pathlib.Path`` that refuses an empty value: ``Path("")`` is the
    current directory, so ``--out ""`` would quietly write there."""

    def __init__(self, **kwargs):
        super().__init__(path_type=Path, **kwargs)

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path names no file", param, ctx)
        return super().convert(value, param, ctx)


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ``argparse`` parser whose usage errors are one ``error:`` line naming ``--help``, exit 2,
    as every other command's are (argparse prints its usage first)."""

    def error(self, message: str):
        print(f"error: {one_line(message)} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


class Pace:
    """The time left at the pace so far, for progress lines in a log (no bar off a terminal):
    ``Pace(total)(done)`` is ", about N s left", or ", N s in all" once done."""

    def __init__(self, total: int, clock=time.monotonic):
        self.total, self.clock, self.started = total, clock, clock()

    def __call__(self, done: int) -> str:
        return ", " + self.phrase(done)

    def phrase(self, done: int) -> str:
        """"about N s left", or "N s in all" once ``done`` reaches the total."""
        spent = self.clock() - self.started
        if done >= self.total:
            return f"{spent:.0f} s in all"
        return f"about {spent / max(done, 1) * (self.total - done):.0f} s left"
