"""The GPU quiet before every leg, and the GPU work a side leaves behind its answer charged to it.

Stopping a worker (its cgroup frozen, or SIGSTOP) stops its CPU, not the work it has already
queued on the GPU: a decoder could answer, leave seconds of kernels queued, and have them run
while the control is timed, which then shares the GPU and looks slow. So between requests both
workers are stopped, and the audit asks the GPU itself whether anything still runs there: a
probe of its own (``CudaProbe``: fixed device-memory traffic in the audit's own CUDA context,
timed on the host from launch to completion, with a small copy to the device and back) takes
about its solo time on an idle GPU and markedly longer while another context's kernels or
copies hold the GPU, which time-slices contexts and shares its memory bandwidth. ``Quiet.wait``
probes until QUIET_RUNS probes in a row take at most QUIET_SLACK times the solo time (staying
off the GPU for BUSY_PAUSE_S after each busy probe) and returns how long the GPU stayed busy
first, 0.0 when the first probe was already quiet.

After each answer, with the answering side stopped, that wait is the GPU work the side left
behind: it is added to the side's leg, so work moved past the answer is still the side's own
time, and the next leg starts on an idle GPU. Before each request the wait finds what anyone
else left (it should find nothing: both sides are stopped). A GPU that stays busy for
QUIET_TIMEOUT_S is ``GpuBusy``: the retime cannot time a leg fairly on it.

On a CPU there is nothing to probe (``NoProbe``): a stopped process runs nothing there.
"""
from __future__ import annotations

import statistics
import time
from typing import Protocol

# a probe is quiet when it takes at most this times the solo probe's time; time-slicing with a
# busy context at least doubles it (bench/gpu_quiet.py)
QUIET_SLACK = 1.5
# quiet probes in a row before the GPU counts as idle: a gap between another context's kernels,
# or a probe that ran just as one finished, is not yet idle
QUIET_RUNS = 3
# probes timed alone at the start; their median is the solo time
CALIBRATION_RUNS = 9
# a GPU busy this long with both sides stopped is not one a leg can be timed on
QUIET_TIMEOUT_S = 120.0
# after a busy probe, the probe stays off the GPU this long: probes back to back would take half of
# a time-sliced GPU and let the work left behind finish at half speed (bench/gpu_quiet.py: a
# stopped process's 0.5 s of products took 1.05 s to drain), charging its side twice its time
BUSY_PAUSE_S = 0.02
# the probe's traffic: NEG_KERNELS passes over a buffer of PROBE_BYTES, each reading it and
# writing a second one (about 2 ms on an H200): longer than a context's time slice, so that
# another context's queued work takes a share of it whenever the GPU is shared
PROBE_BYTES = 512 << 20
NEG_KERNELS = 8
# and a copy of this many floats to the device and back
COPY_ELEMENTS = 1024


class GpuBusy(Exception):
    """The GPU did not go quiet with both sides stopped."""


class Probe(Protocol):
    def run(self) -> float: ...  # seconds, launch to completion


class Clock(Protocol):
    def now(self) -> float: ...


class CudaProbe:
    """Fixed device-memory traffic in the audit's own context on ``device``."""

    def __init__(self, device):
        import torch  # the audit's replay has loaded it already on a GPU

        self.torch, self.device = torch, torch.device(device)
        n = PROBE_BYTES // 4
        self.src = torch.randn(n, device=self.device)
        self.dst = torch.empty_like(self.src)
        # a decode step also copies between host and device (its tokens): a copy engine another
        # context keeps busy delays these
        self.host = torch.zeros(COPY_ELEMENTS, pin_memory=True)
        self.small = torch.zeros(COPY_ELEMENTS, device=self.device)
        self.run()  # the kernels loaded before any probe is timed

    def run(self) -> float:
        t0 = time.perf_counter()
        self.small.copy_(self.host, non_blocking=True)
        for _ in range(NEG_KERNELS):
            self.torch.neg(self.src, out=self.dst)
        self.host.copy_(self.small, non_blocking=True)
        self.torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def close(self) -> None:
        del self.src, self.dst
        self.torch.cuda.empty_cache()


class Quiet:
    """Waits for an idle GPU, as its ``probe`` tells one, on the measurement's ``clock``."""

    def __init__(self, probe: Probe, clock: Clock, solo_s: float | None = None, slack: float = QUIET_SLACK,
                 runs: int = QUIET_RUNS, timeout_s: float = QUIET_TIMEOUT_S, pause=time.sleep):
        self.probe, self.clock, self.slack, self.runs, self.timeout_s = probe, clock, slack, runs, timeout_s
        self.pause = pause  # seconds -> None: real sleep, or a test's clock advanced
        self.solo_s = solo_s
        self.probes = 0

    def calibrate(self) -> float:
        """The solo probe's time: the median of CALIBRATION_RUNS probes, taken while nothing else
        should use the GPU (before the workers start)."""
        self.solo_s = statistics.median(self.probe.run() for _ in range(CALIBRATION_RUNS))
        return self.solo_s

    def wait(self) -> float:
        """Seconds the GPU stayed busy before QUIET_RUNS quiet probes in a row (the first of them
        starting the count); 0.0 when the first probe was quiet. ``GpuBusy`` past the timeout."""
        if self.solo_s is None:
            self.calibrate()
        start = self.clock.now()
        busy_s, in_row, busy_seen = 0.0, 0, False
        while in_row < self.runs:
            at = self.clock.now()
            if at - start > self.timeout_s:
                raise GpuBusy(f"the GPU stayed busy for {at - start:.0f} s with both workers stopped (probe "
                              f"{self.solo_s * 1e3:.1f} ms alone)")
            took = self.probe.run()
            self.probes += 1
            if took <= self.slack * self.solo_s:
                if in_row == 0:  # quiet from this probe on, unless a busy one follows
                    busy_s = at - start if busy_seen else 0.0
                in_row += 1
            else:
                in_row, busy_seen = 0, True
                self.pause(BUSY_PAUSE_S)
        return busy_s

    def describe(self) -> dict:
        return {"probe": "device-memory traffic in the audit's own CUDA context", "solo_ms": self.solo_s * 1e3
                if self.solo_s is not None else None, "slack": self.slack, "runs": self.runs,
                "probes": self.probes}


class NoProbe:
    """A CPU: a stopped process runs nothing, so there is nothing to wait for."""

    probes = 0

    def wait(self) -> float:
        return 0.0

    def describe(self) -> None:
        return None
