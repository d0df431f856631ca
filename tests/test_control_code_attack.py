"""The attack on the control's code, end to end, on a throwaway copy of this checkout.

A plug-in decoder, honest in its tokens and serial in its speed, makes the control slower in
every later process while ``git status`` stays clean, in two ways:

  rewrite  its ``prepare()`` appends a slow-down to ``decoders/serial.py`` and marks the file
           ``assume-unchanged`` in git's index;
  pyc      its ``prepare()`` plants a ``.pyc`` of the slowed module in ``decoders/__pycache__``,
           stamped with the unchanged source's mtime and size, so that Python loads it instead.

The next ``harness time`` takes the slowed control as its baseline and claims a speed-up. Against
the rewrite, the harness's own check of the control's code records the changed file, so the
replay fails it and the retime refuses it (``control-code-modified``). Against the planted ``.pyc``
(the source is unchanged), the retime's control starts with the private pycache its code check
compiled from the checked sources: the planted code never runs there, the verified ratio is the
honest one and the claim is not reproduced.

The copy runs in a venv of its own that sees the copy's packages and this environment's libraries,
so nothing in this checkout is touched.
"""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from audit_helpers import claim_refused

REPO = Path(__file__).resolve().parents[1]
# per decode call of the slowed control (a tiny model's 12-token decode takes 10-100 ms): a claim
# of several times, beyond the judge's allowance (CLAIM_MARGIN above its interval's top) even when
# a loaded host widens that interval; the margin itself is tested in test_retime_judge
SLOW_S = 0.5

PAYLOAD = f'''

_honest_decode = SerialDecoder.decode


def _slowed_decode(self, *args, **kwargs):
    import pathlib, time
    marker = pathlib.Path(__file__).resolve().parent.parent.parent / "slowed.marker"
    marker.write_text(str(__import__("os").getpid()))
    time.sleep({SLOW_S})
    return _honest_decode(self, *args, **kwargs)


_slowed_decode.honest = _honest_decode
SerialDecoder.decode = _slowed_decode
'''

ADVERSARY = '''"""A serial-speed plug-in that slows the control of every later process."""
import importlib.util, marshal, os, pathlib, subprocess, time

from decoders.serial import SerialDecoder

ROOT = pathlib.Path(__file__).resolve().parent
SERIAL = ROOT / "decoders" / "serial.py"
PAYLOAD = %r
# its own decode is the honest one, whatever the control's has become
HONEST = getattr(SerialDecoder.decode, "honest", SerialDecoder.decode)


class Honest(SerialDecoder):
    def decode(self, *args, **kwargs):
        return HONEST(self, *args, **kwargs)


class Rewrites(Honest):
    name = "rewrites"

    def prepare(self, model):
        super().prepare(model)
        if PAYLOAD.strip() not in SERIAL.read_text():
            SERIAL.write_text(SERIAL.read_text() + PAYLOAD)
            subprocess.run(["git", "-C", str(ROOT), "update-index", "--assume-unchanged", "decoders/serial.py"],
                           check=True)


class PlantsPyc(Honest):
    name = "plants-pyc"

    def prepare(self, model):
        super().prepare(model)
        source = SERIAL.read_bytes()
        st = SERIAL.stat()
        code = compile(source.decode() + PAYLOAD, str(SERIAL), "exec")
        # a timestamp pyc: flags 0, the unchanged source's mtime and size
        header = (importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little")
                  + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little") + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little"))
        pyc = pathlib.Path(importlib.util.cache_from_source(str(SERIAL)))
        pyc.parent.mkdir(exist_ok=True)
        pyc.write_bytes(header + marshal.dumps(code))
''' % PAYLOAD


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def checkout(tmp_path):
    """A copy of HEAD with this checkout's built-in models, an adversary module beside it, and a
    venv that imports the copy (not this checkout) and this environment's libraries."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    copy = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(copy)], check=True)
    for name in ("tiny", "small"):
        if not (copy / "fixtures" / name).exists():
            shutil.copytree(REPO / "fixtures" / name, copy / "fixtures" / name)
    (copy / "adversary.py").write_text(ADVERSARY)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (purelib,) = Path(venv).glob("lib/python*/site-packages")
    (purelib / "copy.pth").write_text("\n".join([str(copy), *site.getsitepackages()]) + "\n")
    python = venv / "bin" / "python"
    found = subprocess.run([str(python), "-I", "-c", "import decoders; print(decoders.__file__)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(found).resolve().is_relative_to(copy.resolve()), found
    return copy, python


def run(python: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([str(python), *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=900)


def harness_time(python, copy, decoder: str, out: str) -> Path:
    """Six prompts: the fewest whose median has an interval, which a claimed score needs."""
    out = copy.parent / out  # outside the copy, whose git status is looked at
    done = run(python, copy, "-m", "harness", "time", "--decoder", f"adversary:{decoder}", "--model", "tiny",
               "--device", "cpu", "--out", str(out), "--limit", "6", "-n", "12", "--legs", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "stream.jsonl"


def claimed_ratio(python, copy, stream: Path) -> tuple[int, dict]:
    done = run(python, copy, "-m", "audit", "replay", str(stream), "--out", str(stream.parent / "audit.json"))
    doc = json.loads((stream.parent / "audit.json").read_text())
    return done.returncode, doc


def retime(python, copy, stream: Path) -> tuple[int, dict, str]:
    out = stream.parent / "retime.json"
    done = run(python, copy, "-m", "audit", "retime", str(stream), "--trust-plugin", "--prompts", "6",
               "--out", str(out), "--no-sandbox")
    return done.returncode, (json.loads(out.read_text()) if out.exists() else None), done.stdout + done.stderr


def test_a_rewritten_control_is_named_by_the_harness_the_replay_and_the_retime(checkout):
    copy, python = checkout
    harness_time(python, copy, "Rewrites", "first")  # its prepare() rewrites the control's file
    assert git(copy, "status", "--porcelain") == "?? adversary.py\n"  # git status: clean but for it
    stream = harness_time(python, copy, "Rewrites", "second")  # this run's control is the slowed one
    header = json.loads(stream.read_text().splitlines()[0])
    assert [m["path"].endswith("decoders/serial.py") for m in header["control_code"]["modified"]] == [True]
    code, doc = claimed_ratio(python, copy, stream)
    assert code == 1 and any(f["check"] == "control-code-modified" for f in doc["findings"])
    code, doc, output = retime(python, copy, stream)
    assert code == 1, output[-3000:]
    assert doc["verdict"] == "fail" and not (doc["verified"] or {}).get("score")
    assert any(f["check"] == "control-code-modified" and f["path"].endswith("decoders/serial.py")
               for f in doc["findings"])


def test_a_planted_pyc_never_runs_in_the_retimes_workers(checkout):
    copy, python = checkout
    harness_time(python, copy, "PlantsPyc", "first")  # plants the .pyc
    assert git(copy, "status", "--porcelain") == "?? adversary.py\n"
    stream = harness_time(python, copy, "PlantsPyc", "second")  # loads the planted, slowed control
    marker = copy.parent / "slowed.marker"  # beside the copy: its git status stays clean
    assert marker.exists()  # the harness's own process ran the planted code: the claim is bought
    code, doc = claimed_ratio(python, copy, stream)
    assert doc["claimed_score"] > 0 and doc["exact"]  # the replay's figure is the stream's claim
    assert doc["median_ratio"] > 1.5
    marker.unlink()
    code, doc, output = retime(python, copy, stream)
    assert not marker.exists()  # neither worker loaded the planted .pyc
    assert doc is not None, output[-3000:]
    assert doc["verified"]["score"] == 0 and doc["verified"]["ratio"] < 1.2
    assert code == 1 and claim_refused(doc), output[-3000:]
