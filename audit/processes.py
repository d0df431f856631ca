"""The processes behind a retime's worker: found in /proc, stopped and resumed as one, killed at the end.

A worker runs in a session of its own, and the audit stops the side that is not being timed. A
signal to the worker's process group is not enough: a decoder can start a process in a session
of its own (``start_new_session``, ``setsid``), which the signal misses, or abandon one, which is
then re-parented away from the worker. Either could load the machine while the control is timed.
So the audit makes itself the reaper of its descendants' orphans (Linux
``prctl(PR_SET_CHILD_SUBREAPER)``), and a side is stopped as a tree: every process descended
from its worker (for the candidate, also every orphan the audit adopted), leaves first, the
worker's group last, again until no new process appears. Orphans count as the candidate's: the
control is the audit's own serial decoder, which starts no process. Where there is no /proc, only
the worker's process group is stopped, and ``tree_control()`` says so. A process that is not the
audit's descendant (started before the retime, or by a service manager) is out of its reach; what
it does is seen in ``cpu_sample``: around a leg, the CPU time the machine spent on work other than
the timed worker's, and the time the worker's threads waited for a CPU. Work such a process puts on
a GPU takes little CPU, so ``GpuWatch`` asks the driver, all through a GPU retime, which processes
hold a GPU context, and keeps those that are neither the audit nor its descendants.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37
# scans of /proc per stop: each stops what the last one missed (a process forked meanwhile)
STOP_ROUNDS = 8
# the most seconds spent reaping killed members that were, or became, the audit's children
REAP_S = 2.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# /proc/stat's busy columns after "cpu": user, nice, system, (idle, iowait), irq, softirq
BUSY_COLUMNS = (0, 1, 2, 5, 6)
# seconds between two questions to the GPU driver: a context that lives this long is seen; each
# question costs nvidia-smi's start, tens of ms of CPU that count as other work on both sides alike
GPU_POLL_S = 1.0
# per process holding a compute context: its pid, GPU, memory (MiB) and name (last: it may hold commas)
GPU_QUERY = ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory,process_name", "--format=csv,noheader,nounits"]
MIB = 1 << 20
GPU_QUERY_TIMEOUT_S = 20.0


def tree_control() -> bool:
    """Whether whole process trees can be found here (a /proc that lists parents)."""
    return (PROC / "self" / "stat").is_file()


def set_subreaper(on: bool) -> bool | None:
    """Make this process the reaper of its descendants' orphans (or stop being one); returns what it
    was before, or None where the call is unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        before = ctypes.c_int(0)
        if libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(before), 0, 0, 0) != 0:
            return None
        if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
            return None
        return bool(before.value)
    except (OSError, AttributeError):
        return None


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None if it is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def parent_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every process /proc lists."""
    out = {}
    for entry in os.scandir(PROC):
        if entry.name.isdigit():
            fields = stat_fields(int(entry.name))
            if fields is not None and fields[0] != "Z":  # a zombie runs nothing
                out[int(entry.name)] = (int(fields[1]), int(fields[2]))
    return out


def descendants(roots: set[int], table: dict[int, tuple[int, int]]) -> list[int]:
    """The processes under ``roots`` (not the roots), parents before their children."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, frontier = [], sorted(roots)
    while frontier:
        frontier = [c for p in frontier for c in sorted(children.get(p, ()))]
        out += frontier
    return out


def send(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):  # gone, or already another's pid
        pass


class ProcessTree:
    """One worker's processes. ``adopts_orphans``: the audit's adopted orphans are this tree's too.
    ``outside_group`` collects every process found outside the worker's process group."""

    def __init__(self, pid: int, adopts_orphans: bool):
        self.pid, self.adopts_orphans = pid, adopts_orphans
        self.audit_pid = os.getpid()
        self.not_orphans: set[int] = set()  # the audit's children that are not orphans: the workers, older ones
        self.stopped: list[int] = []
        self.stopped_in_group: set[int] = set()  # of those, the ones in the worker's process group
        self.seen: set[int] = set()  # every member ever found, to reap the ones that were the audit's
        self.outside_group: set[int] = set()
        self.in_box: set[int] = set()  # during one stop: members a frozen cgroup holds
        self.outside_box: set[int] = set()  # members found outside the worker's frozen cgroup
        self.group_stopped = False

    def members(self, table: dict[int, tuple[int, int]]) -> list[int]:
        """The worker's descendants (and adopted orphans with theirs), parents first; not the worker."""
        roots = {self.pid}
        if self.adopts_orphans:
            roots |= {pid for pid, (ppid, _) in table.items()
                      if ppid == self.audit_pid and pid not in self.not_orphans and pid != self.pid}
        out = [pid for pid in roots - {self.pid} if pid in table]
        return out + [pid for pid in descendants(roots, table) if pid not in out]

    def stop(self, frozen=None) -> None:
        """SIGSTOP to every member, leaves first, then to the worker's group; again while new ones
        appear. Without /proc, the group alone. ``frozen(pid)`` says which processes a frozen
        cgroup already holds (``audit.cgroups``): they and the worker get no signal, and each
        member outside it is counted in ``outside_box``."""
        for _ in range(STOP_ROUNDS if tree_control() else 0):
            table = parent_table()
            new = [pid for pid in self.members(table) if pid not in self.stopped and pid not in self.in_box]
            if frozen is not None:
                boxed = [pid for pid in new if frozen(pid)]
                self.in_box.update(boxed)
                self.seen.update(boxed)
                self.outside_group.update(pid for pid in boxed if table[pid][1] != self.pid)
                new = [pid for pid in new if pid not in self.in_box]
                self.outside_box.update(new)
            if not new:
                break
            for pid in reversed(new):
                send(pid, signal.SIGSTOP)
            self.seen.update(new)
            self.outside_group.update(pid for pid in new if table[pid][1] != self.pid)
            self.stopped_in_group.update(pid for pid in new if table[pid][1] == self.pid)
            self.stopped += new
        if frozen is not None:
            self.in_box.clear()
            return
        try:
            os.killpg(self.pid, signal.SIGSTOP)
        except ProcessLookupError:  # the worker is gone: its next read says so
            pass
        self.group_stopped = True

    def resume(self) -> bool:
        """SIGCONT to the worker's group (if ``stop`` signalled it), then to every other process
        ``stop`` stopped, parents first; returns whether the worker itself was sent a SIGCONT. A
        process in the group gets the group's SIGCONT only: a second one, handled apart when the
        first was already delivered, would count as a continue the audit did not send."""
        group = self.group_stopped
        if group:
            try:
                os.killpg(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for pid in self.stopped:
            if not (group and pid in self.stopped_in_group):
                send(pid, signal.SIGCONT)
        self.stopped = []
        self.stopped_in_group = set()
        self.group_stopped = False
        return group

    def kill_members(self) -> int:
        """SIGKILL to every member still running (once the worker has exited), then reap those that
        were, or have become, the audit's children; returns how many were killed."""
        if not tree_control():
            return 0
        members = self.members(parent_table())
        for pid in members:
            send(pid, signal.SIGKILL)
        self.seen.update(members)
        deadline = time.monotonic() + REAP_S
        left = set(self.seen)
        while left and time.monotonic() < deadline:
            for pid in list(left):
                try:
                    if os.waitpid(pid, os.WNOHANG)[0] == pid:
                        left.discard(pid)
                except ChildProcessError:  # not the audit's child: gone, someone else's, or its parent dying
                    fields = stat_fields(pid)
                    if fields is None or int(fields[1]) not in left | {self.audit_pid}:
                        left.discard(pid)
            time.sleep(0.01)
        return len(members)


def busy_ticks() -> int | None:
    """Clock ticks the whole machine (all CPUs) has spent busy, from /proc/stat; None without it."""
    try:
        with open(PROC / "stat") as f:
            columns = f.readline().split()[1:]
    except OSError:
        return None
    return sum(int(columns[i]) for i in BUSY_COLUMNS)


def tree_ticks(pids: list[int], worker: int) -> int:
    """Clock ticks of CPU time of ``pids``, the worker's with the children it reaped."""
    total = 0
    for pid in pids:
        fields = stat_fields(pid)
        if fields is None:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
        if pid == worker:
            total += int(fields[13]) + int(fields[14])  # cutime, cstime: its children that exited
    return total


def wait_ns(pids: list[int]) -> int | None:
    """Nanoseconds the threads of ``pids`` have spent runnable but waiting for a CPU
    (/proc/PID/task/TID/schedstat, second field): what other work took from them. None where the
    kernel keeps no such count."""
    if not (PROC / "self" / "schedstat").is_file():
        return None
    total = 0
    for pid in pids:
        try:
            tasks = os.listdir(PROC / str(pid) / "task")
        except OSError:
            continue
        for tid in tasks:
            try:
                total += int((PROC / str(pid) / "task" / tid / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return total


def peak_rss(tree: ProcessTree | None) -> int | None:
    """The peak resident memory of ``tree``'s processes, in bytes: each one's high-water mark
    (/proc/PID/status ``VmHWM``), summed. None without /proc or without a tree."""
    if tree is None or not tree_control():
        return None
    total = 0
    for pid in [tree.pid] + tree.members(parent_table()):
        try:
            with open(PROC / str(pid) / "status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)
        except (OSError, ValueError, IndexError):
            continue
    return total


def cpu_sample(tree: ProcessTree | None) -> tuple[int, int, int | None] | None:
    """(machine busy ticks, ``tree``'s ticks, ``tree``'s wait in ns); two of them, around a leg,
    give ``leg_cpu``. None without /proc or without a tree."""
    busy = busy_ticks() if tree is not None and tree_control() else None
    if busy is None:
        return None
    pids = [tree.pid] + tree.members(parent_table())
    return busy, tree_ticks(pids, tree.pid), wait_ns(pids)


def leg_cpu(before: tuple[int, int, int | None] | None,
            after: tuple[int, int, int | None] | None) -> dict[str, float | None]:
    """Between two samples of the timed side: ``others_cpu_s``, the CPU seconds the machine spent on
    work other than its tree's (clock-tick resolution, about 10 ms a sample on most systems), and
    ``waited_s``, the seconds its threads waited for a CPU (None each where not measured)."""
    if before is None or after is None:
        return {"others_cpu_s": None, "waited_s": None}
    others = max(0, (after[0] - before[0]) - (after[1] - before[1])) / CLOCK_TICKS
    waited = None if before[2] is None or after[2] is None else max(0, after[2] - before[2]) / 1e9
    return {"others_cpu_s": others, "waited_s": waited}


# The GPU poller: a child of the audit started before its workers (so never taken for an orphan of
# theirs), whose own children are the queries. It prints one JSON line per query, and exits, never
# mid-query (which would leave the query an orphan for the audit to adopt), once its stdin closes.
POLLER = """
import json, select, subprocess, sys
period, query = float(sys.argv[1]), sys.argv[2:]
while True:
    try:
        done = subprocess.run(query, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=%r)
        line = {"rc": done.returncode, "out": done.stdout, "err": done.stderr}
    except FileNotFoundError:
        line = {"error": query[0] + " is not installed"}
    except (OSError, subprocess.TimeoutExpired) as exc:
        line = {"error": query[0] + " failed: " + str(exc)}
    print(json.dumps(line), flush=True)
    if select.select([sys.stdin], [], [], period)[0]:
        break
""" % GPU_QUERY_TIMEOUT_S


@dataclass(frozen=True)
class GpuProcess:
    """One process holding a compute context, as the driver names it."""

    name: str
    gpu: str  # the GPU's UUID
    used_bytes: int | None  # None where the driver cannot say (``[N/A]``)


def read_gpu_answer(answer: dict) -> dict[int, GpuProcess] | str:
    """One poller line: pid -> ``GpuProcess`` of every process holding a compute context on a GPU,
    or why that could not be read."""
    if "error" in answer:
        return str(answer["error"])
    if answer.get("rc") != 0:
        return f"nvidia-smi exited {answer.get('rc')}: {(answer.get('err') or answer.get('out') or '').strip()[:200]}"
    out = {}
    for line in str(answer.get("out", "")).splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",", 3)]
        if len(fields) < 4 or not fields[0].isdigit():
            return f"nvidia-smi gave no process id, GPU, memory and name: {line.strip()[:200]!r}"
        pid, gpu, used, name = fields
        out[int(pid)] = GpuProcess(name, gpu, int(used) * MIB if used.isdigit() else None)
    return out


class GpuWatch:
    """Which processes hold a GPU context, asked every ``poll_s`` from ``start`` to ``stop`` by a
    poller process (``POLLER``); ``foreign`` collects those that are neither the audit nor its
    descendants (its workers, their processes, the orphans it adopted). Start it before the
    workers. The audit holds a context itself while it watches (its replay model is on the GPU): a
    list without its own pid is not in this system's process ids (a container, say), and then
    nothing is judged (``unmeasured`` says why, as it does when the driver cannot be asked).

    Once the workers run (``assign``: each side's process tree), every answer is also read per side:
    ``peak_bytes`` the most GPU memory a side's processes held together in one answer, ``gpus`` the
    GPUs (UUIDs) they held contexts on. The candidate's tree holds the orphans the audit adopted."""

    def __init__(self, poll_s: float = GPU_POLL_S, query: list[str] | None = None):
        self.poll_s, self.query = poll_s, list(query or GPU_QUERY)
        self.audit_pid = os.getpid()
        self.foreign: dict[int, str] = {}
        self.samples = 0
        self.unmeasured: str | None = None
        self.trees: dict[str, ProcessTree] = {}  # role -> its side's processes, once assigned
        self.peak_bytes: dict[str, int] = {}
        self.memory_unknown: set[str] = set()  # sides the driver gave no memory figure for
        self.gpus: dict[str, set[str]] = {}
        self.poller: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> "GpuWatch":
        self.poller = subprocess.Popen([sys.executable, "-c", POLLER, str(self.poll_s), *self.query],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, args=(self.poller.stdout,), name="gpu-watch", daemon=True)
        self._thread.start()
        return self

    def assign(self, trees: dict[str, ProcessTree]) -> None:
        """From now on, read each answer per side: role -> that side's process tree."""
        with self._lock:
            self.trees = dict(trees)

    def stop(self) -> None:
        """Ends the poller after one more answer (what ran since the last one), then reads the rest."""
        if self.poller is None:
            return
        seen = self.samples
        deadline = time.monotonic() + self.poll_s + GPU_QUERY_TIMEOUT_S
        while self.samples == seen and self.unmeasured is None and self._thread.is_alive() \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        self.poller.stdin.close()
        try:
            self.poller.wait(timeout=GPU_QUERY_TIMEOUT_S + 1)
        except subprocess.TimeoutExpired:  # a query that hangs past its own timeout
            self.poller.kill()
            self.poller.wait()
        self._thread.join()
        self.poller = None
        if self.samples == 0 and self.unmeasured is None:
            self.unmeasured = "the GPU's processes were never read"

    def _read(self, answers) -> None:
        before = self.ours()  # a process of the audit's that exits meanwhile is in one of the two
        for line in answers:
            try:
                found = read_gpu_answer(json.loads(line))
            except ValueError:
                found = f"the GPU poller wrote {line.strip()[:200]!r}"
            self.look(found, before)
            before = self.ours()

    def look(self, found: dict[int, GpuProcess] | str, before: set[int]) -> None:
        if self.unmeasured is not None:
            return
        if isinstance(found, str):
            self.unmeasured = found
            return
        if self.audit_pid not in found:
            self.unmeasured = (f"the driver's list of GPU processes ({len(found)}) lacks the audit's own "
                               "process id: its ids are not this system's")
            return
        ours = before | self.ours()
        for pid, proc in found.items():
            if pid not in ours:
                self.foreign.setdefault(pid, proc.name)
        self.per_side(found)
        self.samples += 1

    def per_side(self, found: dict[int, GpuProcess]) -> None:
        """One answer's memory and GPUs, summed per side (a side: its worker and the members of its
        process tree, ``ProcessTree.members``)."""
        with self._lock:
            trees = dict(self.trees)
        if not trees:
            return
        table = parent_table() if tree_control() else {}
        sides = {tree.pid: role for role, tree in trees.items()}
        for role, tree in trees.items():
            sides.update({pid: role for pid in tree.members(table)} if table else {})
        used: dict[str, int] = {}
        for pid, proc in found.items():
            role = sides.get(pid)
            if role is None:
                continue
            self.gpus.setdefault(role, set()).add(proc.gpu)
            if proc.used_bytes is None:
                self.memory_unknown.add(role)
            else:
                used[role] = used.get(role, 0) + proc.used_bytes
        for role, total in used.items():
            self.peak_bytes[role] = max(self.peak_bytes.get(role, 0), total)

    def ours(self) -> set[int]:
        if not tree_control():
            return {self.audit_pid}
        return {self.audit_pid, *descendants({self.audit_pid}, parent_table())}
