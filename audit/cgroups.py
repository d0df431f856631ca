"""A worker in a cgroup v2 of its own, where the OS offers one: frozen, pinned and killed as a whole.

``Box.create(name)`` makes a child of the audit's own cgroup on the cgroup2 mount (found in
``/proc/self/mountinfo``: ``/sys/fs/cgroup`` on a unified host, ``/sys/fs/cgroup/unified`` on a
hybrid one). A worker enters it before it runs anything (``enter_argv``: a shell writes its own
pid to ``cgroup.procs``, then execs the worker), so every process it ever starts is in the box:
a new session, a double fork or re-parenting changes nothing, since cgroup membership is inherited
and only a process that may write to the cgroup tree can leave. The candidate's sandbox mounts
that tree read-only.

  freeze   ``cgroup.freeze`` = 1, then wait for ``cgroup.events`` to say ``frozen 1``: the kernel
           stops every member at once; no signal is involved, so no SIGCONT from anyone undoes it.
  thaw     ``cgroup.freeze`` = 0.
  pin      ``cpuset.cpus``, where the parent delegates the cpuset controller to its children (else
           ``pinned`` says why not); both sides get the same CPUs, so neither can spread wider.
  kill     ``cgroup.kill`` (Linux 5.14+), else SIGKILL to each pid in ``cgroup.procs``; then the
           directory is removed.
  usage    ``cpu.stat``'s ``usage_usec``: the CPU time of every member, the departed included.

Where there is no writable cgroup2, ``Box.create`` returns None and says why; the audit then
stops and kills the worker's process tree by signals (``audit.processes``).
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
SELF_CGROUP = Path("/proc/self/cgroup")
FREEZE_WAIT_S = 5.0  # a freeze the kernel has not confirmed by then is a failure, not a wait
POLL_S = 0.001


class CgroupError(RuntimeError):
    pass


def cgroup2_mount(mountinfo: Path = MOUNTINFO) -> Path | None:
    """Where the cgroup2 hierarchy is mounted, or None."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] == "cgroup2":
            return Path(left.split()[4])
    return None


def own_cgroup(self_cgroup: Path = SELF_CGROUP) -> str | None:
    """This process's cgroup2 path (the ``0::`` line), or None."""
    try:
        for line in self_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                return line[3:]
    except OSError:
        pass
    return None


def cgroup_of(pid: int) -> str | None:
    return own_cgroup(Path(f"/proc/{pid}/cgroup"))


def where() -> tuple[Path | None, str, str]:
    """The directory under which the audit may make boxes and its cgroup2 path, or None and why."""
    mount = cgroup2_mount()
    if mount is None:
        return None, "", "no cgroup2 hierarchy is mounted"
    own = own_cgroup()
    if own is None:
        return None, "", "this process is in no cgroup2"
    parent = mount / own.lstrip("/")
    if not (parent / "cgroup.procs").is_file():
        return None, "", f"its cgroup {parent} is not visible here"
    if not os.access(parent, os.W_OK):
        return None, "", f"its cgroup {parent} is not writable"
    return parent, own, ""


@dataclass
class Box:
    path: Path
    relative: str  # the box's path as /proc/PID/cgroup names it
    pinned: str | None = None  # the CPUs it is pinned to, or why not ("not pinned: ...")

    @classmethod
    def create(cls, name: str, cpus: str | None = None) -> tuple["Box | None", str]:
        """A fresh box named ``name`` (with this process's pid, so two audits never share one),
        pinned to ``cpus`` where it can be; or None and why."""
        parent, own, why = where()
        if parent is None:
            return None, why
        path = parent / f"{name}-{os.getpid()}"
        try:
            path.mkdir()
        except OSError as exc:
            return None, f"cannot make a cgroup under {parent}: {exc.strerror}"
        if not (path / "cgroup.freeze").is_file():
            path.rmdir()
            return None, "this kernel's cgroup2 has no cgroup.freeze (Linux 5.2+)"
        box = cls(path, own.rstrip("/") + "/" + path.name)
        box.pinned = box.pin(cpus) if cpus else None
        return box, ""

    def _write(self, name: str, value: str) -> None:
        try:
            (self.path / name).write_text(value)
        except OSError as exc:
            raise CgroupError(f"cgroup {self.path}: writing {name}: {exc.strerror}") from None

    def pin(self, cpus: str) -> str:
        controllers = (self.path / "cgroup.controllers").read_text().split()
        if "cpuset" not in controllers:
            return "not pinned: the parent cgroup delegates no cpuset controller"
        try:
            self._write("cpuset.cpus", cpus)
        except CgroupError as exc:
            return f"not pinned: {exc}"
        return cpus

    def enter_argv(self, argv: list[str]) -> list[str]:
        """``argv`` started inside the box: the shell moves itself in (``0`` is the writer), then
        becomes the command, so nothing runs outside first."""
        return ["/bin/sh", "-c", 'echo 0 > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv]

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def holds(self, pid: int) -> bool:
        return cgroup_of(pid) == self.relative

    def frozen(self) -> bool:
        try:
            for line in (self.path / "cgroup.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "frozen":
                    return value.strip() == "1"
        except OSError:
            pass
        return False

    def freeze(self, wait_s: float = FREEZE_WAIT_S) -> None:
        """Every member stopped by the kernel, confirmed (``cgroup.events``) before it returns."""
        self._write("cgroup.freeze", "1")
        deadline = time.monotonic() + wait_s
        while not self.frozen():
            if time.monotonic() > deadline:
                raise CgroupError(f"cgroup {self.path} did not freeze within {wait_s:.0f} s")
            time.sleep(POLL_S)

    def thaw(self) -> None:
        self._write("cgroup.freeze", "0")

    def usage_us(self) -> int | None:
        """CPU microseconds spent by every process that ever ran in the box."""
        try:
            for line in (self.path / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value)
        except (OSError, ValueError):
            pass
        return None

    def kill(self) -> int:
        """Every member killed (a frozen one too: SIGKILL ends a frozen task), the box removed;
        returns how many were in it."""
        members = self.pids()
        if (self.path / "cgroup.kill").is_file():
            try:
                self._write("cgroup.kill", "1")
            except CgroupError:
                pass
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self._write("cgroup.freeze", "0")
        except CgroupError:
            pass
        deadline = time.monotonic() + FREEZE_WAIT_S
        while self.pids() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        try:
            self.path.rmdir()
        except OSError:
            pass
        return len(members)

    def describe(self) -> dict:
        return {"cgroup": self.relative, "freeze": "cgroup.freeze", "pinned": self.pinned}
