"""``audit.processes.GpuWatch``: which processes hold a GPU context during a retime, told apart
into the audit's own and those out of its reach, with a stand-in for nvidia-smi."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from audit.processes import GpuProcess, GpuWatch, read_gpu_answer

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="process trees are read from /proc")


def lister(*rows: str) -> list[str]:
    """A stand-in for nvidia-smi's query that prints these csv rows."""
    return [sys.executable, "-c", "import sys; print('\\n'.join(sys.argv[1:]))", *rows]


def watched(query: list[str]) -> GpuWatch:
    watch = GpuWatch(poll_s=0.05, query=query).start()
    watch.stop()
    return watch


def test_the_driver_answer_is_read_or_said_unreadable():
    assert read_gpu_answer({"rc": 0, "out": "502, GPU-a, 10, python\n546, GPU-a, 20, /usr/bin/python3\n", "err": ""}) == {
        502: GpuProcess("python", "GPU-a", 10 << 20), 546: GpuProcess("/usr/bin/python3", "GPU-a", 20 << 20)}
    assert read_gpu_answer({"rc": 0, "out": "", "err": ""}) == {}
    assert read_gpu_answer({"rc": 9, "out": "", "err": "NVIDIA-SMI has failed\n"}).startswith("nvidia-smi exited 9")
    assert "no process id" in read_gpu_answer({"rc": 0, "out": "[N/A], GPU-a, 10, python\n", "err": ""})
    assert "no process id" in read_gpu_answer({"rc": 0, "out": "502, python\n", "err": ""})
    assert read_gpu_answer({"error": "nvidia-smi is not installed"}) == "nvidia-smi is not installed"


def test_only_processes_out_of_the_audits_tree_are_foreign():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        watch = watched(lister(f"{os.getpid()}, GPU-a, 100, audit", f"{child.pid}, GPU-a, 100, worker",
                               "1, GPU-a, 100, init"))
    finally:
        child.kill()
        child.wait()
    assert watch.unmeasured is None and watch.samples >= 1
    assert watch.foreign == {1: "init"}


def test_a_list_without_the_audit_is_not_judged():
    watch = watched(lister("1, GPU-a, 100, init", "2, GPU-a, 100, other"))
    assert watch.foreign == {} and "lacks the audit's own process id" in watch.unmeasured


def test_no_driver_is_said_and_not_judged():
    watch = watched(["no-such-nvidia-smi-here", "--query-compute-apps=pid"])
    assert watch.foreign == {} and watch.unmeasured == "no-such-nvidia-smi-here is not installed"
