"""What every ``audit`` command shares: the one ``error:`` line for what stops a command, and the
options parsed alike (``--sampling``, ``--device``)."""
from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable

import click

from core.errors import DistError, Stopped, UserError, fail


def run_command(fn: Callable[[], int], worded: dict[type[Exception], str] | None = None):
    """Run a command's one function and exit with the code it returns. What stops it is one line
    on stderr and exit 2 (130 for ^C), never a traceback: a user's mistake (under torchrun every
    rank meets it alike, so rank 0 alone says it), or a rank's or replay worker's own news (a
    failure, a hang, a stop), said by that rank and prefixed with it. ``worded``: the command's own
    exceptions, each shown after its prefix."""
    from core import dist  # imports torch: loads only when a command runs

    from audit.report import printable

    # a SIGTERM (timeout, kill, a cancelled job) becomes Stopped, so the command's own cleanup runs:
    # a retime's workers and their cgroups are ended, never left frozen behind it (a handler can be
    # set from the main thread only; the one before is back once the command ends)
    previous = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if previous is not None:
        dist.install_stop_handler()
    try:
        code = fn()
    except UserError as exc:
        fail(printable(str(exc)), quiet=dist.quiet_rank())
    except DistError as exc:
        fail(dist.rank_prefix() + str(exc))
    except Stopped:
        who = "by the launcher " if dist.topology().active else ""
        fail(dist.rank_prefix() + f"stopped {who}(SIGTERM); nothing was written")
    except KeyboardInterrupt:
        fail("interrupted; nothing was written", 130)
    except tuple(worded or ()) as exc:
        prefix = next(words for kind, words in worded.items() if isinstance(exc, kind))
        fail(printable(f"{prefix}: {exc}"))
    finally:  # a rank that has reported ignores SIGTERM (dist.ignore_stop): that stays
        if previous is not None and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
            signal.signal(signal.SIGTERM, previous)
    sys.exit(code)


def parse_sampling(text: str | None):
    """``--sampling SPEC`` as a ``core.sampling.Sampler`` (None: greedy); bad SPEC is a UserError."""
    from core.sampling import GREEDY, Sampler, SamplerError  # imports torch: only when a command runs

    if text is None:
        return GREEDY
    try:
        return Sampler.parse(text)
    except SamplerError as exc:
        raise UserError(f"--sampling {text!r}: {exc}") from None


def check_device_option(device: str | None) -> None:
    """``--device`` checked before any file is read or model loaded (``core.devices``)."""
    from core.devices import check_device  # torch loads only when a command runs

    check_device(device)
