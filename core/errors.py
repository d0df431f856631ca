"""Errors that are the user's to fix: the CLIs print them as one line and exit non-zero."""
import signal
import sys
from typing import Callable, NoReturn

EXIT_INTERRUPTED = 130  # a shell's status for a process ended by Ctrl-C (128 + SIGINT)


class UserError(Exception):
    """Bad input (a path, a flag, a file): shown as one line, never as a traceback."""


class DistError(Exception):
    """Under torchrun a rank, or in a replay pool (``audit.pool``) a worker, failed, hung or was
    stopped, so the whole run fails. Shown as one line naming the rank or worker (and its prompt
    where there is one); nothing is written."""


class Stopped(BaseException):
    """This rank was sent SIGTERM: torchrun stops every rank once one has exited with an error.
    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` (a decoder's, or the
    per-prompt guard's) can swallow it and leave this rank waiting for one that is gone."""


def fail(message, code: int = 2, quiet: bool = False):
    """The CLIs' one way out for a user's error: ``error: MESSAGE`` on one line of stderr (a
    library's multi-line text folded in), then exit ``code``; ``quiet`` exits without a word
    (under torchrun, the ranks that are not rank 0)."""
    message = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    if not quiet:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def run_cli(main: Callable[[], object]) -> NoReturn:
    """A ``python -m`` entry: exits with ``main()``'s status (an int it returns; 0 for anything
    else). A Ctrl-C that the command does not answer itself, the imports ``main`` does first
    included, is one ``error: interrupted`` line and exit 130, never a traceback. Once ``main``
    has returned, a Ctrl-C while the interpreter shuts down is ignored."""
    try:
        status = main()
    except KeyboardInterrupt:
        fail("interrupted", EXIT_INTERRUPTED)
    # the command has done its work and said so: a Ctrl-C in the shutdown (torch's teardown can
    # take a second) would only turn that into a traceback or a bare exit 130. SIGTERM still ends it.
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing to protect
        pass
    sys.exit(status if isinstance(status, int) and not isinstance(status, bool) else 0)
