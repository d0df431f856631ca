"""Progress lines of a training run: timestamped, on stdout, flushed at once (a run's log is its record)."""
from __future__ import annotations

import time


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
