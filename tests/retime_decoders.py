"""Plug-in decoders that game timing, for ``audit retime``'s tests (``--decoder
retime_decoders:NAME``; a subprocess needs ``PYTHONPATH=tests``): ``Precomputed`` and
``PrecomputedUneven`` answer the built-in prompts from a table made in ``prepare()``;
``LoadsTheControl`` and ``LoadsTheControlFromOutside`` leave processes that burn the machine while
the control is timed, in the worker's tree but out of its process group, or out of the audit's
reach; ``StopsTheControlFromOutside`` leaves one that pauses the control's worker instead;
``PrecomputedSpace`` decodes in ``prepare()`` every prompt of the small space a custom prompt
file's tokens span; ``PeeksAtTheFreshFile`` decodes in ``prepare()`` the auditor's --fresh
prompts, where it can read them; ``SerialSpeed`` is serial decoding made slower still, for forged
claims."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time

from core.errors import UserError
from core.prompts import load_prompts
from decoders.base import DecodeResult, DecodeStats, stop_index
from decoders.serial import SerialDecoder


class Precomputed:
    """Exact, and instant on the built-in prompt set it loads itself in ``prepare()``: it decodes
    every prompt of the model's default set there (untimed) and answers those from a table; any
    other prompt gets plain serial decoding. A table answer takes a steady ``answer_s``, as a
    plausible fast decoder would (an instant one would look like a cache to the warm-leg check)."""

    name = "precomputed"

    def __init__(self, max_new_tokens: int = 64, answer_s: float = 0.004):
        self.max_new_tokens = max_new_tokens
        self.answer_s = answer_s
        self.inner = SerialDecoder()
        self.table: dict[tuple, list[int]] = {}
        self.eos: tuple[int, ...] = ()

    def prepare(self, model) -> None:
        self.inner.prepare(model)
        self.eos = tuple(model.eos_token_ids)
        prompts, _ = load_prompts(None, model)
        for p in prompts:
            self.table[tuple(p.token_ids)] = self.inner.decode(p.token_ids, self.max_new_tokens).tokens

    def config(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "answer_s": self.answer_s}

    def decode(self, prompt_ids, max_new_tokens) -> DecodeResult:
        known = self.table.get(tuple(prompt_ids))
        if known is not None and max_new_tokens <= self.max_new_tokens:
            time.sleep(self.answer_s)
            return DecodeResult(known[:stop_index(known, self.eos, max_new_tokens)], DecodeStats())
        return self.inner.decode(prompt_ids, max_new_tokens)


class PrecomputedUneven(Precomputed):
    """Precomputed that also spoils its own later legs: every second decode of a prompt it does not
    know sleeps ``spoil_s`` more, so that each of the retime's prompts looks unstable and is
    measured again on its spare, hoping that noise favours one of the two first legs."""

    name = "precomputed-uneven"

    def __init__(self, max_new_tokens: int = 64, answer_s: float = 0.004, spoil_s: float = 0.3):
        super().__init__(max_new_tokens, answer_s)
        self.spoil_s = spoil_s
        self.seen: dict[tuple, int] = {}

    def decode(self, prompt_ids, max_new_tokens) -> DecodeResult:
        key = tuple(prompt_ids)
        if key not in self.table:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] % 2 == 0:
                time.sleep(self.spoil_s)
        return super().decode(prompt_ids, max_new_tokens)


# The spinner of LoadsTheControl: a process in a session of its own (out of reach of a signal to
# its worker's process group) that burns a core whenever the process it watches is stopped, which
# in a retime is while the control is timed, noting each burst in a log. It outlives that process.
SPINNER = """
import os, sys, time
watched, log = int(sys.argv[1]), sys.argv[2]
if log:
    with open(log + ".pids", "a") as f:
        f.write(f"{os.getpid()}\\n")
gone_since = None
while True:
    try:
        with open(f"/proc/{watched}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except OSError:  # outlives its worker, so that only the audit's kill ends it (or a minute, if none comes)
        gone_since = gone_since or time.monotonic()
        if time.monotonic() - gone_since > 60:
            break
        time.sleep(0.1)
        continue
    if state in ("T", "t"):
        end = time.perf_counter() + 0.005
        while time.perf_counter() < end:
            pass
        if log:
            with open(log, "a") as f:
                f.write("ran while the worker was stopped\\n")
    else:
        time.sleep(0.001)
"""


# Starts SPINNER (its arguments after this one's) and exits at once, so that the spinner is an
# orphan: re-parented out of the worker's tree, to init or to the nearest reaper of orphans.
ORPHANING = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
"""


def written_pids(log: str) -> list[int]:
    try:
        with open(log + ".pids") as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def in_retime_worker() -> bool:
    return sys.argv[0].endswith(os.path.join("harness", "worker.py"))


class LoadsTheControl:
    """Exact (serial decoding underneath, so no faster than the control), but in a retime's worker
    ``prepare()`` starts one spinner per core (``SPINNER``) that burns the machine whenever the
    worker is stopped, i.e. while the control is timed: each in a session of its own, which a
    signal to the worker's process group never reaches, and with ``orphan`` also abandoned, out of
    the worker's process tree. Each spinner's pid goes to ``log + ".pids"`` and each burst to
    ``log``. (In ``harness time``'s process it starts nothing: in-process, a thread could slow the
    control anyway, which is why the retime exists.)"""

    name = "loads-the-control"

    def __init__(self, log: str = "", spinners: int = 0, orphan: bool = False):
        self.log, self.orphan = log, orphan
        self.spinners = spinners or os.cpu_count() or 1
        self.inner = SerialDecoder()

    def prepare(self, model) -> None:
        self.inner.prepare(model)
        if not in_retime_worker():
            return
        spinner = [SPINNER, str(os.getpid()), self.log]
        for _ in range(self.spinners):
            command = [sys.executable, "-c", ORPHANING, *spinner] if self.orphan else [sys.executable, "-c", *spinner]
            launched = subprocess.Popen(command, start_new_session=True)
            if self.orphan:
                launched.wait()
        while self.log and len(written_pids(self.log)) < self.spinners:  # each spinner writes its own
            time.sleep(0.01)

    def config(self) -> dict:
        return {"log": self.log, "spinners": self.spinners, "orphan": self.orphan}

    def decode(self, prompt_ids, max_new_tokens) -> DecodeResult:
        return self.inner.decode(prompt_ids, max_new_tokens)


# The start of the scripts below: their arguments, their pid noted, and the retime's workers found
# by their command lines (a worker, not another of these scripts, whose command lines name it too).
OUTSIDE_START = """
import os, signal, sys, time
needle, pids, lifetime = sys.argv[1].encode(), sys.argv[2], float(sys.argv[3])
with open(pids, "a") as f:
    f.write(f"{os.getpid()}\\n")

def workers():
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"-m\\x00harness.worker\\x00" in cmd:
            yield entry, cmd

def cgroup2_mount():
    with open("/proc/self/mountinfo") as f:
        return next((l.partition(" - ")[0].split()[4] for l in f if l.partition(" - ")[2].startswith("cgroup2 ")), None)

MOUNT = cgroup2_mount()

def stopped(pid):
    # stopped by a signal, or frozen in its cgroup v2: either way the other side is being timed
    with open(f"/proc/{pid}/stat") as f:
        if f.read().rpartition(")")[2].split()[0] in ("T", "t"):
            return True
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            path = next(l[3:].strip() for l in f if l.startswith("0::"))
        with open(f"{MOUNT}{path}/cgroup.events") as f:
            return "frozen 1" in f.read()
    except (OSError, StopIteration, TypeError):
        return False
"""

# The spinner of LoadsTheControlFromOutside: started by `harness time`'s run of the decoder, it
# outlives that run, finds the candidate's worker of a later retime by its command line, and burns
# a core whenever that worker is stopped. It is not the audit's descendant: no stop reaches it. It
# exits after LIFETIME seconds, or once a worker it found is gone.
OUTSIDER = OUTSIDE_START + """
start, watched = time.monotonic(), None
while time.monotonic() - start < lifetime:
    if watched is None:
        watched = next((pid for pid, cmd in workers() if needle in cmd), None)
        time.sleep(0.01)
        continue
    try:
        frozen = stopped(watched)
    except OSError:
        break
    if frozen:
        end = time.perf_counter() + 0.005
        while time.perf_counter() < end:
            pass
    else:
        time.sleep(0.001)
"""


class LoadsTheControlFromOutside:
    """Exact (serial decoding underneath), but its run in ``harness time`` leaves one spinner per
    core behind (``OUTSIDER``, orphaned, so not the retime's descendant) that burns the machine
    whenever a later retime's candidate worker is stopped, i.e. while the control is timed. Each
    spinner's pid goes to ``pids``."""

    name = "loads-the-control-from-outside"

    def __init__(self, pids: str = "", spinners: int = 0, lifetime: float = 300.0):
        self.pids, self.lifetime = pids, lifetime
        self.spinners = spinners or os.cpu_count() or 1
        self.inner = SerialDecoder()

    def prepare(self, model) -> None:
        self.inner.prepare(model)
        if in_retime_worker():
            return
        outsider = [OUTSIDER, type(self).__name__, self.pids, str(self.lifetime)]
        for _ in range(self.spinners):
            subprocess.Popen([sys.executable, "-c", ORPHANING, *outsider], start_new_session=True).wait()

    def config(self) -> dict:
        return {"pids": self.pids, "spinners": self.spinners, "lifetime": self.lifetime}

    def decode(self, prompt_ids, max_new_tokens) -> DecodeResult:
        return self.inner.decode(prompt_ids, max_new_tokens)


# The stopper of StopsTheControlFromOutside: started by `harness time`'s run of the decoder, it
# outlives that run, finds a later retime's two workers by their command lines, and while the
# candidate's is stopped (the control is timed) pauses the control's again and again: SIGSTOP, a
# few ms, SIGCONT. It takes almost no CPU. It exits after LIFETIME seconds, or once a worker is gone.
STOPPER = OUTSIDE_START + """
start, candidate, control = time.monotonic(), None, None
while time.monotonic() - start < lifetime:
    if candidate is None or control is None:
        for pid, cmd in workers():
            if needle in cmd:
                candidate = pid
            elif b"--decoder\\x00serial\\x00" in cmd:
                control = pid
        time.sleep(0.01)
        continue
    try:
        timing_control = stopped(candidate)
        if timing_control:
            os.kill(int(control), signal.SIGSTOP)
            time.sleep(0.004)
            os.kill(int(control), signal.SIGCONT)
        time.sleep(0.004 if timing_control else 0.001)
    except (OSError, ProcessLookupError):
        break
"""


class StopsTheControlFromOutside(LoadsTheControlFromOutside):
    """Exact (serial decoding underneath), but its run in ``harness time`` leaves one process behind
    (``STOPPER``, orphaned, out of the retime's reach) that pauses the retime's control worker with
    SIGSTOP and SIGCONT while the control is timed: no CPU load, no wait for a CPU, a slower control."""

    name = "stops-the-control-from-outside"

    def __init__(self, pids: str = "", lifetime: float = 300.0):
        super().__init__(pids, 1, lifetime)

    def prepare(self, model) -> None:
        self.inner.prepare(model)
        if in_retime_worker():
            return
        stopper = [STOPPER, type(self).__name__, self.pids, str(self.lifetime)]
        subprocess.Popen([sys.executable, "-c", ORPHANING, *stopper], start_new_session=True).wait()

    def config(self) -> dict:
        return {"pids": self.pids, "lifetime": self.lifetime}


class PrecomputedSpace(Precomputed):
    """Exact, and instant on every prompt of a small space it enumerates in ``prepare()``: every
    sequence, of each length the prompt file ``prompts`` holds, over the token ids its prompts use
    (a space of at most ``max_space`` prompts). A retime that drew its fresh prompts from the
    stream's own prompt tokens would only ever send it prompts of that space."""

    name = "precomputed-space"

    def __init__(self, prompts: str = "", max_new_tokens: int = 64, answer_s: float = 0.004, max_space: int = 64):
        super().__init__(max_new_tokens, answer_s)
        self.prompts, self.max_space = prompts, max_space

    def prepare(self, model) -> None:
        self.inner.prepare(model)
        self.eos = tuple(model.eos_token_ids)
        held, _ = load_prompts(self.prompts, model)
        alphabet = sorted({t for p in held for t in p.token_ids})
        for length in sorted({len(p.token_ids) for p in held}):
            if len(alphabet) ** length > self.max_space:
                raise ValueError(f"a space of {len(alphabet)}^{length} prompts is too large to precompute")
            for ids in itertools.product(alphabet, repeat=length):
                self.table[ids] = self.inner.decode(list(ids), self.max_new_tokens).tokens

    def config(self) -> dict:
        return {**super().config(), "prompts": self.prompts, "max_space": self.max_space}


class PeeksAtTheFreshFile(Precomputed):
    """Precomputed, and in ``prepare()`` it also reads the auditor's prompt file ``fresh`` (what a
    retime is given as --fresh), where it can: every prompt there, cut to each length of the
    built-in set's first ``limit`` prompts (the lengths a retime's fresh prompts mirror), decoded
    in advance and answered from the table. A file it cannot read (hidden by the sandbox) adds
    nothing."""

    name = "peeks-at-the-fresh-file"

    def __init__(self, fresh: str = "", limit: int = 3, max_new_tokens: int = 64, answer_s: float = 0.004):
        super().__init__(max_new_tokens, answer_s)
        self.fresh, self.limit = fresh, limit

    def prepare(self, model) -> None:
        super().prepare(model)
        try:
            peeked, _ = load_prompts(self.fresh, model)
        except UserError:  # hidden: it reads as an empty device, no prompt file
            return
        lengths = {len(p.token_ids) for p in load_prompts(None, model)[0][:self.limit]}
        for p in peeked:
            for n in lengths & set(range(len(p.token_ids) + 1)):
                self.table[tuple(p.token_ids[:n])] = self.inner.decode(p.token_ids[:n], self.max_new_tokens).tokens

    def config(self) -> dict:
        return {**super().config(), "fresh": self.fresh, "limit": self.limit}


class SerialSpeed(SerialDecoder):
    """Serial decoding, and then idle for ``slow`` times as long again (by default half serial's
    speed): an exact decoder no faster than the control, slow enough that no burst of a loaded
    machine's noise lifts its retimed interval near the forged claims of the tests."""

    name = "serial-speed"

    def __init__(self, slow: float = 1.0):
        super().__init__()
        self.slow = slow

    def config(self) -> dict:
        return {"slow": self.slow}

    def decode(self, prompt_ids, max_new_tokens) -> DecodeResult:
        t0 = time.perf_counter()
        result = super().decode(prompt_ids, max_new_tokens)
        time.sleep(self.slow * (time.perf_counter() - t0))
        return result


class LeavesGpuWork(SerialDecoder):
    """Serial decoding, the control's own speed, that in a retime's worker leaves GPU work queued
    behind every answer: once its tokens are known it queues ``burn`` times its own decode's time
    of matrix products on a low-priority stream and keeps its worker's synchronisation from
    waiting for them (``torch.cuda.synchronize`` made a no-op in its process). It decodes on a
    high-priority stream, so its own next decode runs ahead of what it left. Stopping its worker
    stops its CPU, not that queue: unless the audit waits for the GPU, the products run while the
    control is timed, which then shares the GPU and looks slower. Elsewhere (``harness time``) and
    off CUDA it is plain serial decoding."""

    name = "leaves-gpu-work"

    def __init__(self, burn: float = 1.0, size: int = 8192):
        super().__init__()
        self.burn, self.size = burn, size
        self.product_s = 0.0
        self.side = None

    def config(self) -> dict:
        return {"burn": self.burn, "size": self.size}

    def prepare(self, model) -> None:
        import torch

        super().prepare(model)
        if model.device.type != "cuda" or not in_retime_worker():
            return
        self.a = torch.randn(self.size, self.size, device=model.device, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.a)
        # a lower number runs first; 0 is the lowest priority, one out of range the nearest valid
        self.side = torch.cuda.Stream(model.device, priority=0)
        self.own = torch.cuda.Stream(model.device, priority=-100)
        torch.matmul(self.a, self.a, out=self.out)
        torch.cuda.synchronize(model.device)
        t0 = time.perf_counter()
        for _ in range(20):
            torch.matmul(self.a, self.a, out=self.out)
        torch.cuda.synchronize(model.device)
        self.product_s = (time.perf_counter() - t0) / 20
        torch.cuda.synchronize = lambda device=None: None  # the worker's wait after a decode, undone

    def decode(self, prompt_ids, max_new_tokens, **kwargs) -> DecodeResult:
        import torch

        if self.side is None:
            return super().decode(prompt_ids, max_new_tokens, **kwargs)
        t0 = time.perf_counter()
        with torch.cuda.stream(self.own):
            result = super().decode(prompt_ids, max_new_tokens, **kwargs)
        with torch.cuda.stream(self.side):
            for _ in range(max(1, round(self.burn * (time.perf_counter() - t0) / self.product_s))):
                torch.matmul(self.a, self.a, out=self.out)
        return result
