"""``audit retime`` of a sampled stream (tiny, CPU): both workers (``python -m harness.worker
--sampling``) decode with the header's sampler, the retimed legs are replayed with it, and
retime.json records it. The worker itself: its requests decode with the sampler it was started
with, and a sampler it cannot honour is an error line at start."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from audit_helpers import findings, run_harness
from core.sampling import Sampler

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SPEC = "temperature=0.6,top_k=20,top_p=0.95,seed=11"
FRESH = 6  # the fewest fresh prompts a retime takes


@pytest.fixture(autouse=True)
def workers_import_tests(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))


def test_sampled_stream_retimes_with_exact_sampled_tokens(tmp_path):
    stream = run_harness(tmp_path / "run", "fast-serial", limit=3, n=24, legs=2, extra=("--sampling", SPEC))
    from audit.cli import main as audit_main

    result = CliRunner().invoke(audit_main, ["retime", str(stream), "--device", "cpu", "--prompts", str(FRESH)])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    doc = json.loads((stream.parent / "retime.json").read_text())
    # a noisy machine may leave the claim unverified; the tokens must be exact whatever the timing
    assert doc["verdict"] in ("pass", "unverified"), result.output
    assert doc["sampler"] == Sampler.parse(SPEC).to_json()
    assert doc["prompts"] and all(e["exact"] for e in doc["prompts"])
    assert not findings(doc, "exactness") and not findings(doc, "stop") and not findings(doc, "header-disagrees")
    assert "sampling temperature=0.6,top_k=20,top_p=0.95,seed=11" in result.output  # both workers were told


def worker(*args):
    cmd = [sys.executable, "-m", "harness.worker", "--model", "tiny", "--device", "cpu", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_the_worker_decodes_with_its_sampler(tiny):
    from decoders.serial import SerialDecoder

    sampler = Sampler.parse(SPEC)
    ids = [5, 17, 42, 99, 3, 250, 7]
    serial = SerialDecoder()
    serial.prepare(tiny)
    want = serial.decode(ids, 12, sampler=sampler).tokens
    assert want != serial.decode(ids, 12).tokens
    for spec in (json.dumps(sampler.to_json()), SPEC):
        proc = worker("--decoder", "spec", "--sampling", spec)
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"] is True and ready["sampler"] == sampler.to_json()
        out, _ = proc.communicate(json.dumps({"prompt_ids": ids, "max_new_tokens": 12}) + "\n", timeout=300)
        assert json.loads(out.splitlines()[0])["tokens"] == want
        assert proc.returncode == 0


@pytest.mark.parametrize("args,says", [
    (("--decoder", "fast-serial", "--sampling", "temperature=-1"), "--sampling"),
    (("--decoder", "fast-serial", "--sampling", '{"name": "gumbel-max/v2", "temperature": "x"}'), "--sampling"),
    (("--decoder", "spec-naive", "--sampling", SPEC), "does not sample"),
])
def test_a_sampler_the_worker_cannot_honour_is_an_error_line(args, says):
    proc = worker(*args)
    out, _ = proc.communicate("", timeout=300)
    assert proc.returncode == 2
    assert says in json.loads(out.splitlines()[0])["error"]
