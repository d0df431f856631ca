"""`harness time --control NAME`: a candidate timed side by side against another reference.

The audit still replays every token against serial greedy decoding, and never scores such a run:
its ratio is against the reference, not against the control that defines exactness.
"""
import json

from click.testing import CliRunner

from audit.cli import main as audit_main
from harness.cli import main as harness_main


def test_fast_serial_reference_is_audited_but_not_scored(tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(harness_main, ["time", "--model", "tiny", "--control", "fast-serial", "--decoder", "spec", "--limit", "2",
                                            "-n", "10", "--legs", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    header = json.loads((out / "stream.jsonl").read_text().splitlines()[0])
    assert header["control"]["name"] == "fast-serial" and header["candidate"]["name"] == "spec"
    res = CliRunner().invoke(audit_main, ["replay", str(out / "stream.jsonl")])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "audit.json").read_text())
    assert doc["exact"] and doc["verdict"] == "pass" and doc["score"] == 0.0
    assert doc["reference"] == "fast-serial"
    assert [f["severity"] for f in doc["findings"] if f["check"] == "reference"] == ["warn"]


def test_unknown_reference_is_a_clear_error(tmp_path):
    res = CliRunner().invoke(harness_main, ["time", "--control", "nope", "--limit", "1", "-n", "4",
                                            "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "unknown decoder 'nope'" in res.output
    assert not (tmp_path / "x" / "stream.jsonl").exists()
