"""How busy the machine was before timing began, and the warning it earns."""
from __future__ import annotations

import os

# the 1-minute load average, as a share of the CPUs, above which timings are called noisy: torch's
# CPU ops use every core (and the eager control is host-bound on a GPU), so when other work keeps
# half of them busy a leg's time depends on the scheduler
BUSY_LOAD_SHARE = 0.5


def machine_load() -> tuple[float, int] | None:
    """(1-minute load average, CPU count), read before this run adds to it; None where unknown."""
    try:
        return os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):  # no load average on this platform
        return None


def busy_warning(load: tuple[float, int] | None) -> str | None:
    if load is None or load[0] <= BUSY_LOAD_SHARE * load[1]:
        return None
    return (f"WARNING: this machine is busy (1-minute load average {load[0]:.2f} on {load[1]} CPUs, above "
            f"{BUSY_LOAD_SHARE:.0%} of them) before timing began: expect noisy legs")
