"""The harness checks the control's code before it times and records the check in the header; the
replay fails a stream whose check found a changed file, and says so when a stream records none."""
from __future__ import annotations

import pytest

from audit import checks
from audit_helpers import read_records, run_audit, run_harness


def modified(path: str) -> dict:
    return {"checked": 10, "reference": "git HEAD abc", "seconds": 0.1, "unverified": [], "startup": [],
            "modified": [{"path": path, "reference": "git HEAD abc", "expected": "1", "actual": "2"}]}


def test_a_recorded_change_fails_and_names_the_file():
    found = checks.check_control_code({"control_code": modified("/x/decoders/serial.py")})
    assert [(f["check"], f["severity"], f["path"]) for f in found] == [
        ("control-code-modified", "fail", "/x/decoders/serial.py")]


def test_an_unchanged_check_passes_and_a_missing_one_is_named():
    assert checks.check_control_code({"control_code": {**modified("x"), "modified": []}}) == []
    assert [f["severity"] for f in checks.check_control_code({})] == ["warn"]
    assert [f["severity"] for f in checks.check_control_code({"control_code": {"modified": "x"}})] == ["fail"]
    unproven = {**modified("x"), "modified": [], "unverified": ["/y/decoders/serial.py"],
                "unproven": ["/y/decoders/serial.py"]}
    (f,) = checks.check_control_code({"control_code": unproven})
    assert (f["check"], f["severity"], f["paths"]) == ("control-code-unverified", "warn", ["/y/decoders/serial.py"])
    # another library's file no reference covers (virtualenv's own shim) is no finding
    shim = {**modified("x"), "modified": [], "unverified": ["/venv/site-packages/_virtualenv.py"], "unproven": []}
    assert checks.check_control_code({"control_code": shim}) == []


@pytest.fixture(scope="module")
def control_from_elsewhere_stream(tmp_path_factory):
    """A real harness run whose check's interpreter read the control from another place than the
    harness process imports it from (stubbed: the check reports other files for its modules)."""
    mp = pytest.MonkeyPatch()
    from core import provenance

    unchanged = {**modified("x"), "modified": []}
    mp.setattr(provenance, "control_code_header",
               lambda **kw: (unchanged, [], {"decoders.serial": "/elsewhere/decoders/serial.py"}))
    try:
        return run_harness(tmp_path_factory.mktemp("elsewhere") / "run", "fast-serial", limit=1, n=6, legs=1)
    finally:
        mp.undo()


def test_a_control_imported_from_elsewhere_than_checked_fails(control_from_elsewhere_stream, tmp_path):
    import decoders.serial

    (m,) = read_records(control_from_elsewhere_stream)[0]["control_code"]["modified"]
    assert (m["path"], m["expected"]) == (decoders.serial.__file__, "/elsewhere/decoders/serial.py")
    result, doc = run_audit(control_from_elsewhere_stream, out=tmp_path / "audit.json")
    assert result.exit_code == 1 and doc["verdict"] == "fail" and doc["exact"]
    assert [f["path"] for f in doc["findings"] if f["check"] == "control-code-modified"] == [decoders.serial.__file__]


@pytest.fixture(scope="module")
def changed_control_stream(tmp_path_factory):
    """A real harness run whose provenance check found a changed file (the check itself stubbed:
    the checkout is never modified)."""
    mp = pytest.MonkeyPatch()
    from core import provenance

    mp.setattr(provenance, "control_code_header", lambda **kw: (modified("/x/core/models.py"), [], {}))
    try:
        return run_harness(tmp_path_factory.mktemp("changed") / "run", "fast-serial", limit=1, n=6, legs=1)
    finally:
        mp.undo()


def test_the_header_records_the_check_and_the_replay_fails_it(changed_control_stream, tmp_path):
    header = read_records(changed_control_stream)[0]
    assert header["control_code"]["modified"][0]["path"] == "/x/core/models.py"
    result, doc = run_audit(changed_control_stream, out=tmp_path / "audit.json")
    assert result.exit_code == 1 and doc["verdict"] == "fail" and doc["exact"]
    assert any(f["check"] == "control-code-modified" for f in doc["findings"])
