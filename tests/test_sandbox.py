"""audit.sandbox: the plan this machine offers, the warning where it offers none, and (as root with
util-linux, as here and in CI) what a command inside can and cannot do: write outside its private
directory, reach the network, remount, leave a process alive; stopped and continued as a tree."""
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from audit import sandbox
from audit.processes import ProcessTree, parent_table, stat_fields

UNSHARE = bool(shutil.which("unshare") and shutil.which("setpriv") and os.geteuid() == 0 and not shutil.which("bwrap"))
needs_unshare = pytest.mark.skipif(not UNSHARE, reason="the unshare route needs root, util-linux unshare and setpriv")

PROBE = r"""
import json, os, socket, subprocess, sys
out = {"pid": os.getpid()}
for name, path in (("outside", sys.argv[1]), ("inside", os.environ["TMPDIR"] + "/ok"), ("shm", "/dev/shm/x")):
    try:
        with open(path, "w") as f:
            f.write("x")
        out[name] = "written"
    except OSError as e:
        out[name] = e.strerror
try:
    socket.create_connection(("10.0.0.1", 9), timeout=5)
    out["net"] = "connected"
except OSError as e:
    out["net"] = e.strerror
out["remount"] = subprocess.run(["mount", "-o", "remount,rw", "/"], capture_output=True).returncode
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[2]], start_new_session=True)
print(json.dumps(out))
"""


def test_no_tool_gives_the_warning():
    plan = sandbox.plan("/tmp", which=lambda name: None, root=True)
    assert plan.tool is None and plan.prefix == () and plan.warning.startswith("candidate-not-sandboxed: ")
    not_root = sandbox.plan("/tmp", which=lambda name: None if name == "bwrap" else f"/usr/bin/{name}", root=False)
    assert not_root.tool is None and "root" in not_root.warning
    assert not_root.wrap(["x"]) == ["x"]


def test_bwrap_is_preferred_where_installed(tmp_path):
    plan = sandbox.plan(tmp_path, which=lambda name: f"/usr/bin/{name}", root=False)
    assert plan.tool == "bwrap" and plan.warning is None
    p = list(plan.prefix)
    assert p[0] == "/usr/bin/bwrap" and p[-1] == "--"
    for flag in ("--unshare-pid", "--unshare-net", "--die-with-parent"):
        assert flag in p
    assert p[p.index("--ro-bind"):p.index("--ro-bind") + 3] == ["--ro-bind", "/", "/"]
    assert ["--bind", str(tmp_path), str(tmp_path)] == p[p.index("--bind"):p.index("--bind") + 3]
    assert p[p.index("--cap-drop") + 1] == "ALL"


def test_unshare_as_root(tmp_path):
    plan = sandbox.plan(tmp_path, which=lambda name: None if name == "bwrap" else f"/usr/bin/{name}", root=True)
    assert plan.tool == "unshare" and plan.warning is None
    assert plan.prefix[:7] == ("/usr/bin/unshare", "--mount", "--pid", "--net", "--fork", "--mount-proc", "--kill-child")
    assert "/usr/bin/setpriv" in plan.prefix and "--bounding-set=-all" in plan.prefix


def test_hidden_paths_are_planned_by_their_real_paths(tmp_path):
    secret, folder, link = tmp_path / "fresh.jsonl", tmp_path / "folder", tmp_path / "link"
    secret.write_text("{}")
    folder.mkdir()
    link.symlink_to(secret)
    hide = (link, secret, folder, tmp_path / "missing")  # a link and its file are hidden once
    bwrap = sandbox.plan(tmp_path, which=lambda name: f"/usr/bin/{name}", root=False, hide=hide)
    assert bwrap.hidden == (str(secret), str(folder)) and bwrap.describe()["hidden"] == [str(secret), str(folder)]
    p = list(bwrap.prefix)
    assert ["--ro-bind", "/dev/null", str(secret)] == p[p.index(str(secret)) - 2:p.index(str(secret)) + 1]
    assert ["--tmpfs", str(folder), "--remount-ro", str(folder)] == p[p.index(str(folder)) - 1:p.index(str(folder)) + 3]
    assert p.index(str(secret)) > p.index("/sys")  # over the read-only root, not under it
    unshare = sandbox.plan(tmp_path, which=lambda name: None if name == "bwrap" else f"/usr/bin/{name}", root=True,
                           hide=hide)
    assert unshare.hidden == bwrap.hidden
    i = unshare.prefix.index(sandbox.INIT)
    assert unshare.prefix[i + 1:i + 4] == (str(tmp_path), json.dumps([str(secret), str(folder)]), "/usr/bin/setpriv")
    # no sandbox: nothing is hidden, and the plan says so
    assert sandbox.plan(tmp_path, which=lambda name: None, root=True, hide=hide).hidden == ()


def test_unsandboxed_the_warning_names_what_it_could_read():
    from audit.retime.provenance import sandbox_findings

    assert sandbox_findings(sandbox.Sandbox("unshare", ("unshare",)), ("/a/fresh.jsonl",)) == []
    (none,) = sandbox_findings(None, ("/a/fresh.jsonl",))
    assert none["check"] == sandbox.NOT_SANDBOXED and none["severity"] == "warn"
    assert none["message"].endswith("--no-sandbox; it could read /a/fresh.jsonl, which a sandbox hides from it")
    (no_tool,) = sandbox_findings(sandbox.plan("/tmp", which=lambda name: None, root=True, hide=("/tmp",)))
    assert "could read" not in no_tool["message"]


def test_launch_gives_a_private_pycache(tmp_path):
    launch = sandbox.launch(["python"], sandbox=False, environ={"PYTHONUSERBASE": "/x", "A": "1"})
    try:
        pycache = launch.env["PYTHONPYCACHEPREFIX"]
        # on the command line too: a worker runs with -I, which ignores PYTHON* variables
        assert launch.sandbox is None and launch.argv == ["python", "-X", f"pycache_prefix={pycache}"]
        assert pycache.startswith(launch.tmpdir) and "PYTHONUSERBASE" not in launch.env
        assert launch.env["A"] == "1" and os.path.isdir(launch.tmpdir)
    finally:
        launch.cleanup()
    assert not os.path.exists(launch.tmpdir)


def live_with(marker: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes() and stat_fields(int(entry))[0] != "Z":
                out.append(int(entry))
        except (OSError, TypeError, ValueError):
            continue
    return out


@needs_unshare
def test_inside_the_sandbox(tmp_path):
    marker = f"sandbox-probe-{uuid.uuid4()}"
    outside = tmp_path / "escaped"
    launch = sandbox.launch([sys.executable, "-I", "-c", PROBE, str(outside), marker], sandbox=True)
    try:
        assert launch.sandbox.tool == "unshare"
        done = subprocess.run(launch.argv, env=launch.env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
    finally:
        launch.cleanup()
    assert out["pid"] == 1  # init of its PID namespace
    assert out["outside"] == "Read-only file system" and not outside.exists()
    assert out["inside"] == "written" and out["shm"] == "written"
    assert out["net"] in ("Network is unreachable", "Cannot assign requested address")
    assert out["remount"] != 0  # no capability left to make anything writable again
    assert live_with(marker) == []  # its detached child died with the namespace
    assert not os.path.exists(launch.tmpdir)


READER = r"""
import json, os, subprocess, sys
out = {}
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path):
            out[path] = sorted(os.listdir(path))
        else:
            with open(path) as f:
                out[path] = f.read()
    except OSError as e:
        out[path] = e.strerror
out["umount"] = [subprocess.run(["umount", p], capture_output=True).returncode for p in sys.argv[1:]]
out["again"] = open(sys.argv[1]).read()
print(json.dumps(out))
"""


@needs_unshare
def test_hidden_paths_cannot_be_read_inside(tmp_path):
    """A hidden file reads as empty inside, under its own name and through a symlink, while a file
    beside it reads as it is; a hidden directory is empty; no unmount brings them back."""
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    secret, beside, link = prompts / "fresh.jsonl", prompts / "other.jsonl", tmp_path / "link.jsonl"
    secret.write_text('{"id": "mine", "text": "the auditor\'s own prompt"}\n')
    beside.write_text("not hidden\n")
    link.symlink_to(secret)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "inside").write_text("x")
    paths = [secret, link, beside, folder, folder / "inside"]
    launch = sandbox.launch([sys.executable, "-I", "-c", READER, *map(str, paths)], sandbox=True, hide=(link, folder))
    try:
        assert launch.sandbox.hidden == (str(secret), str(folder))
        done = subprocess.run(launch.argv, env=launch.env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
    finally:
        launch.cleanup()
    assert out[str(secret)] == out[str(link)] == out["again"] == ""
    assert out[str(beside)] == "not hidden\n"
    assert out[str(folder)] == [] and out[str(folder / "inside")] == "No such file or directory"
    assert all(code != 0 for code in out["umount"])  # no capability left to unmount them
    assert secret.read_text().startswith('{"id": "mine"') and (folder / "inside").read_text() == "x"  # outside, as it was


WORKER = r"""
import signal, sys
n = 0
def h(s, f):
    global n
    n += 1
signal.signal(signal.SIGCONT, h)
signal.siginterrupt(signal.SIGCONT, False)
print("ready", flush=True)
for line in sys.stdin:
    print(n, flush=True)
"""


@needs_unshare
def test_stopped_and_continued_as_a_tree_inside(tmp_path):
    """The worker is pid 1 of its namespace, under unshare: the audit's tree stop reaches it (SIGSTOP
    from the parent namespace), and it counts one SIGCONT per resume."""
    marker = f"sandbox-worker-{uuid.uuid4()}"
    older = {pid for pid, (ppid, _) in parent_table().items() if ppid == os.getpid()}  # earlier tests' children
    launch = sandbox.launch([sys.executable, "-I", "-c", WORKER, marker], sandbox=True)
    proc = subprocess.Popen(launch.argv, env=launch.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            bufsize=1, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        (inner,) = [p for p in live_with(marker) if p != proc.pid and stat_fields(p)[1] != str(os.getpid())]
        tree = ProcessTree(proc.pid, adopts_orphans=True)
        tree.not_orphans = older | {proc.pid}  # as audit.retime.workers.start_workers sets it
        for resumes in (1, 2, 3):
            tree.stop()
            while stat_fields(inner)[0] not in ("T", "t"):  # the stop lands asynchronously
                pass
            tree.resume()
            proc.stdin.write("?\n")
            proc.stdin.flush()
            assert int(proc.stdout.readline()) == resumes
        assert tree.outside_group == set()  # the worker stays in the tool's process group
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
        launch.cleanup()
    assert live_with(marker) == []


def test_launch_with_the_interpreters_own_pycache(tmp_path):
    """The candidate's worker: no private pycache on its command line or in its environment."""
    from core.provenance import PROCESS_PYCACHE

    launch = sandbox.launch(["python", "-I"], sandbox=False, pycache=PROCESS_PYCACHE, environ={"A": "1"})
    try:
        assert launch.argv == ["python", "-I"] and "PYTHONPYCACHEPREFIX" not in launch.env
        assert launch.env["A"] == "1" and os.path.isdir(launch.tmpdir)
    finally:
        launch.cleanup()
