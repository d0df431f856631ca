"""Progress of a run: timestamped log lines on stdout, flushed at once (a run's log is its record),
and progress bars with an ETA on stderr (tqdm), drawn only on a terminal."""
from __future__ import annotations

import sys
import time

from tqdm import tqdm


def log(msg: str) -> None:
    progress_write(f"[{time.strftime('%H:%M:%S')}] {msg}", sys.stdout)


def progress_write(line: str, file) -> None:
    """``line`` on ``file``, above any progress bar on the terminal rather than through it."""
    tqdm.write(line, file=file)
    file.flush()


def progress(total: int | None, desc: str, unit: str = "it") -> tqdm:
    """A progress bar with an ETA on stderr; ``disable=None`` draws it only when stderr is a
    terminal, so logs and captured output get the log lines alone. Use as a context manager."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None, leave=False,
                dynamic_ncols=True)
