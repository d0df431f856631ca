"""How many positions a runtime's static state holds, and how many this process has built.

Static state (K/V buffers, kept rows, the head's cache, the RoPE table) is allocated for a fixed
number of positions, and every CUDA graph captured over it is bound to those buffers, so a longer
decode needs a new runtime, graphs and all: seconds on a large model. A decoder therefore sizes
its state once, before anything is timed, for the longest decode it will be asked for
(``reserve`` in ``decoders.base``). ``builds()`` counts every runtime built in this process, so
that the harness can tell a leg whose time includes a build (``harness.timing``).

Capacities are rounded up to ``STEP`` positions, never doubled: the buffers grow linearly with
the capacity (about 44 KB a position on the 9B shape for ``spec``), so doubling a 17k need would
allocate for 32k.
"""
from __future__ import annotations

DEFAULT_CAPACITY = 4096  # positions a decoder prepares for when nobody reserves more
STEP = 256  # capacities are multiples of this

_builds = 0


def capacity_for(positions: int, floor: int = 0) -> int:
    """The capacity that holds ``positions``: at least ``floor``, rounded up to ``STEP``."""
    return max(int(floor), -(-int(positions) // STEP) * STEP)


def note_build() -> None:
    """A runtime's static state (and the graphs over it) was just allocated."""
    global _builds
    _builds += 1


def builds() -> int:
    """How many runtimes (``ExactRuntime``, ``MTPDrafter``) this process has built so far."""
    return _builds
