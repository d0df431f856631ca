"""audit.cgroups: a worker's cgroup v2 holds every process it starts (new sessions and orphans
too), freezes them all at once so that no SIGCONT resumes them, and kills them all. Skipped where
this machine offers no writable cgroup v2."""
import os
import signal
import subprocess
import sys

import pytest

from audit import cgroups

WHERE = cgroups.where()
pytestmark = pytest.mark.skipif(WHERE[0] is None, reason=f"no writable cgroup v2: {WHERE[2]}")

# a process that starts a spinner in a session of its own and abandons it (a double fork), then
# prints both pids and spins itself
ESCAPER = r"""
import os, sys
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, (str(os.getpid()) + "\n").encode())
        while True:
            pass
    os._exit(0)
print(os.getpid(), int(os.read(r, 32)), flush=True)
while True:
    pass
"""


@pytest.fixture
def box():
    made, why = cgroups.Box.create("qwen35-test", cpus=str(min(os.sched_getaffinity(0))))
    assert made is not None, why
    yield made
    made.kill()


def start(box):
    proc = subprocess.Popen(box.enter_argv([sys.executable, "-c", ESCAPER]), stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    worker, spinner = (int(x) for x in proc.stdout.readline().split())
    return proc, worker, spinner


def ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_the_box_holds_a_new_session_and_an_orphan(box):
    proc, worker, spinner = start(box)
    assert worker == proc.pid or box.holds(worker)
    assert box.holds(spinner) and spinner in box.pids()
    assert os.getsid(spinner) != os.getsid(worker)


def test_a_frozen_box_runs_nothing_and_a_sigcont_does_not_thaw_it(box):
    proc, worker, spinner = start(box)
    box.freeze()
    assert box.frozen()
    for pid in (worker, spinner):
        os.kill(pid, signal.SIGCONT)  # what an accomplice outside would send
    before = {pid: ticks(pid) for pid in (worker, spinner)}
    usage = box.usage_us()
    # a busy loop of the test's own, long enough for a running spinner to gain a tick
    deadline = ticks(os.getpid()) + 5
    while ticks(os.getpid()) < deadline:
        pass
    assert box.frozen() and box.usage_us() == usage
    assert {pid: ticks(pid) for pid in (worker, spinner)} == before
    box.thaw()
    assert not box.frozen()


def test_kill_ends_every_member_frozen_or_not(box):
    proc, worker, spinner = start(box)
    box.freeze()
    assert box.kill() >= 2
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert not box.path.exists()
    assert not os.path.exists(f"/proc/{spinner}") or open(f"/proc/{spinner}/stat").read().split()[2] == "Z"


def test_pinning_where_cpusets_are_delegated(box):
    if box.pinned.startswith("not pinned"):
        assert "cpuset" in box.pinned
    else:
        assert (box.path / "cpuset.cpus").read_text().strip() == box.pinned
