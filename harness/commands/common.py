"""What every ``harness`` command shares: user mistakes as one ``error:`` line."""
from __future__ import annotations

from core.errors import DistError, Stopped, UserError, fail

def run_cli(fn):
    """Turn user mistakes into one line and a non-zero exit; never a traceback for them. Under
    torchrun every rank meets a user mistake alike, so only rank 0 prints it; a rank's own news
    (a hang it saw, a stop) is printed by that rank, prefixed with it."""
    from core import dist  # imports torch: loads only when a command runs

    try:
        return fn()
    except UserError as exc:
        fail(str(exc), quiet=dist.quiet_rank())
    except DistError as exc:
        fail(dist.rank_prefix() + str(exc), 1)
    except Stopped:
        fail(dist.rank_prefix() + "stopped by SIGTERM; nothing was written", 1)
    except KeyboardInterrupt:
        fail("interrupted; nothing was written", 130)
