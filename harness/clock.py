"""The clock every leg of a run is timed by."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Clock:
    """Monotonic seconds since the run began, shared by every leg of a run. The counter is the
    ``time.perf_counter`` of the moment the run began, so a later patch of it does not reach legs."""

    origin: float
    counter: Callable[[], float]

    @classmethod
    def start(cls) -> "Clock":
        counter = time.perf_counter
        return cls(counter(), counter)

    def now(self) -> float:
        return self.counter() - self.origin
