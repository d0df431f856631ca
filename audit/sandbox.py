"""A candidate's worker in a sandbox of its own: mount, PID and network namespaces, through an
existing tool.

``plan(tmpdir, hide=paths)`` picks the tool and returns the argv prefix that runs a command inside:

  bwrap    bubblewrap, where it is installed: the whole tree bound read-only (``--ro-bind / /``),
           ``/dev`` and a fresh ``/proc`` of the namespace, a private tmpfs on ``/dev/shm``, the
           private directory bound writable, ``/dev/null`` bound over each hidden file and an empty
           read-only tmpfs over each hidden directory, no network, every capability dropped, the
           sandbox dying with its parent (``--die-with-parent``).
  unshare  util-linux ``unshare --mount --pid --net --fork --mount-proc --kill-child`` when the audit
           runs as root; inside, ``INIT`` (stdlib only, given as ``python -I -S -c``) mounts a private
           tmpfs on ``/dev/shm``, binds the private directory onto itself, hides each hidden path
           as bwrap does, remounts every other mount read-only (``/proc`` keeps its namespace's
           pids but its kernel knobs, ``/proc/sys``, ``/proc/sysrq-trigger`` and the like, are bound
           read-only), then ``setpriv`` drops every capability (bounding set included, so no exec
           regains one, and no new privileges): a candidate that is uid 0 cannot remount anything
           writable again, nor unmount what hides a path.
  None     neither: ``warning`` says ``candidate-not-sandboxed`` and why.

Inside, the filesystem is read-only except the private directory (``TMPDIR`` points there) and
the private ``/dev/shm``, both thrown away afterwards; a hidden file or directory reads as empty
under every name that leads to it through symlinks (it is hidden at its real path); the only
network device is a loopback that is down; the candidate's worker is pid 1 of its PID namespace,
so every process it starts dies when it exits (the kernel kills the rest of a namespace with its
init), and none can see or signal a process outside. Device nodes stay usable on a read-only mount (``/dev/nvidia*`` for
CUDA), and ``/sys`` stays readable.

The worker still talks to the audit over its stdin and stdout, which the tool passes through.
Stopping it as a process tree keeps working: the audit sees the namespace's processes under their
outer pids in its own ``/proc``, the worker is in the tool's process group, and a signal from the
parent namespace reaches the namespace's init (SIGSTOP and SIGKILL always; SIGCONT resumes a
stopped process whatever its handlers, and the worker counts it with its own handler).

What a sandbox does not stop: a privileged process outside it, and anything the candidate does
through what it may still read (the model, the checkout, a hard link to or a copy of a hidden
file) or the GPU it shares.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from core.provenance import PROCESS_PYCACHE

NOT_SANDBOXED = "candidate-not-sandboxed"
UNSHARE = ("unshare", "--mount", "--pid", "--net", "--fork", "--mount-proc", "--kill-child")
SETPRIV = ("setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--")
# /proc entries through which uid 0 changes the kernel for every process (Docker's read-only list)
PROC_READ_ONLY = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs")

# Run inside the fresh namespaces by the unshare route, as root, before the command: stdlib only.
# argv: the private directory, the paths to hide (a JSON list), then the command. Exits 125 with one
# line on stderr if it cannot.
INIT = r"""
import ctypes, json, os, sys
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
         "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
libc = ctypes.CDLL(None, use_errno=True)
private, hidden, command = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]

def mount(src, target, fstype, flags, data=None):
    if libc.mount(src.encode() if src else None, target.encode(), fstype.encode() if fstype else None,
                  ctypes.c_ulong(flags), data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        sys.stderr.write(f"sandbox: mount {target}: {os.strerror(err)}\n")
        sys.exit(125)

def unescape(path):
    return path.encode().decode("unicode_escape") if "\\" in path else path

def mounts():
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            yield unescape(fields[4]), fields[5].split(",")

def under(path, top):
    return path == top or path.startswith(top.rstrip("/") + "/")

if os.path.isdir("/dev/shm"):
    mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
mount(private, private, None, MS_BIND)
for path in hidden:  # before the remount below, which makes these read-only too
    if os.path.isdir(path):
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0555,size=4k")
    else:
        mount("/dev/null", path, None, MS_BIND)
for entry in PROC_READ_ONLY:
    if os.path.exists(entry):
        mount(entry, entry, None, MS_BIND)
kept = [private, "/dev/shm"]
done = set()
for target, options in list(mounts()):
    if target in done or any(under(target, k) for k in kept) or (under(target, "/proc") and target not in PROC_READ_ONLY):
        continue
    done.add(target)
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY
    for o in options:
        flags |= FLAGS.get(o, 0)
    mount(None, target, None, flags)
os.environ["TMPDIR"] = private
try:
    os.execvp(command[0], command)
except OSError as exc:
    sys.stderr.write(f"sandbox: cannot run {command[0]}: {exc}\n")
    sys.exit(125)
"""
INIT = f"PROC_READ_ONLY = {PROC_READ_ONLY!r}\n" + INIT


@dataclass(frozen=True)
class Sandbox:
    """How a command runs sandboxed: ``prefix`` goes before its argv (empty without a sandbox);
    ``warning`` is None, or ``candidate-not-sandboxed: why``."""

    tool: str | None
    prefix: tuple[str, ...] = ()
    tmpdir: str | None = None
    warning: str | None = None
    env: dict = field(default_factory=dict)  # set for the command (TMPDIR: the private directory)
    hidden: tuple[str, ...] = ()  # real paths the command cannot read (none without a tool)

    def wrap(self, command: list[str]) -> list[str]:
        return [*self.prefix, *command]

    def describe(self) -> dict:
        """For retime.json: the tool, its prefix, the warning, the paths hidden."""
        return {"tool": self.tool, "prefix": list(self.prefix), "tmpdir": self.tmpdir, "warning": self.warning,
                "hidden": list(self.hidden)}


def is_root() -> bool:
    return getattr(os, "geteuid", lambda: -1)() == 0


def hidden_paths(paths) -> tuple[str, ...]:
    """The real path of each of ``paths`` that exists, once: a path reached through symlinks ends
    there, so hiding it hides every such name."""
    out = []
    for p in paths:
        real = os.path.realpath(p)
        if os.path.lexists(real) and real not in out:
            out.append(real)
    return tuple(out)


def bwrap_prefix(bwrap: str, tmpdir: str, hidden: tuple[str, ...] = ()) -> tuple[str, ...]:
    hide = []
    for path in hidden:
        hide += ["--tmpfs", path, "--remount-ro", path] if os.path.isdir(path) else ["--ro-bind", "/dev/null", path]
    return (bwrap, "--ro-bind", "/", "/", "--dev-bind", "/dev", "/dev", "--proc", "/proc",
            "--tmpfs", "/dev/shm", "--bind", tmpdir, tmpdir, "--ro-bind", "/sys", "/sys", *hide,
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--die-with-parent",
            "--cap-drop", "ALL", "--setenv", "TMPDIR", tmpdir, "--")


def unshare_prefix(unshare: str, setpriv: str, tmpdir: str, hidden: tuple[str, ...] = ()) -> tuple[str, ...]:
    return (unshare, *UNSHARE[1:], "--", sys.executable, "-I", "-S", "-c", INIT, tmpdir, json.dumps(list(hidden)),
            setpriv, *SETPRIV[1:])


def plan(tmpdir: str | os.PathLike, which=shutil.which, root: bool | None = None, hide=()) -> Sandbox:
    """The sandbox this machine offers for a command whose only writable place is ``tmpdir`` and
    that cannot read the files and directories ``hide`` names (``hidden_paths``): bubblewrap where
    installed, else unshare as root, else none (with the warning why, and nothing hidden).
    ``which`` and ``root`` are injectable for tests."""
    tmpdir = str(Path(tmpdir).resolve())
    root = is_root() if root is None else root
    env = {"TMPDIR": tmpdir}
    hidden = hidden_paths(hide)
    bwrap = which("bwrap")
    if bwrap:
        return Sandbox("bwrap", bwrap_prefix(bwrap, tmpdir, hidden), tmpdir, env=env, hidden=hidden)
    unshare, setpriv = which("unshare"), which("setpriv")
    if unshare and setpriv and root:
        return Sandbox("unshare", unshare_prefix(unshare, setpriv, tmpdir, hidden), tmpdir, env=env, hidden=hidden)
    why = ("neither bubblewrap (bwrap) is installed nor "
           + ("util-linux unshare and setpriv are" if root else "is the audit root, for util-linux unshare"))
    return Sandbox(None, (), tmpdir, f"{NOT_SANDBOXED}: {why}; the candidate's worker runs with the audit's "
                                     "filesystem, network and process view", env=env)


@contextlib.contextmanager
def private_dir(prefix: str = "qwen35-sandbox-"):
    """A private temporary directory (mode 0700) for one worker, removed with everything in it
    afterwards."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def sandboxed(which=shutil.which, root: bool | None = None):
    """A private directory and the sandbox plan around it; the directory is removed on exit."""
    with private_dir() as tmp:
        yield plan(tmp, which=which, root=root)


@dataclass
class Launch:
    """One worker's argv and environment, and its private directory (``cleanup`` removes it)."""

    argv: list[str]
    env: dict
    tmpdir: str
    sandbox: Sandbox | None  # None: not asked for (the control)

    def cleanup(self) -> None:
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def launch(command: list[str], sandbox: bool, which=shutil.which, root: bool | None = None,
           environ: dict | None = None, pycache: str | None = None, hide=()) -> Launch:
    """How to start ``command`` (a ``python -I`` worker, ``command[0]`` the interpreter) with a
    private directory of its own, and, with ``sandbox``, inside this machine's sandbox (``plan``),
    the directory its only writable place and the paths ``hide`` names out of its sight.

    ``pycache``: None, a pycache in the private directory (empty, so no ``.pyc`` written before is
    loaded: given as ``-X pycache_prefix``, since ``-I`` ignores ``PYTHONPYCACHEPREFIX``); a
    directory, that private pycache (the control's: what the check of its code compiled);
    ``PROCESS_PYCACHE``, the interpreter's own ``__pycache__`` files (the candidate's: whatever
    they hold runs only in the candidate's own process, which runs code of its choosing anyway,
    and inside the sandbox it cannot write them)."""
    tmpdir = tempfile.mkdtemp(prefix="qwen35-worker-")
    env = dict(os.environ if environ is None else environ)
    if pycache != PROCESS_PYCACHE:
        pycache = pycache or os.path.join(tmpdir, "pycache")
        command = [command[0], "-X", f"pycache_prefix={pycache}", *command[1:]]
        env["PYTHONPYCACHEPREFIX"] = pycache
    env.pop("PYTHONUSERBASE", None)
    if not sandbox:
        return Launch(list(command), env, tmpdir, None)
    sb = plan(tmpdir, which=which, root=root, hide=hide)
    return Launch(sb.wrap(command), {**env, **sb.env}, tmpdir, sb)
