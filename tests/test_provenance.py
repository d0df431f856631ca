"""core.provenance: the control's code checked against git HEAD and RECORD. Modified files are
simulated in temporary copies (a git repository of their own, or a RECORD map pointing at a
temporary file); the real checkout and installed packages are never touched."""
import base64
import hashlib
import subprocess

import pytest

from core import provenance
from core.provenance import GitReference, check_control_code, control_code_header, git_blob_sha


def git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                   env={"PATH": "/usr/bin:/bin", "HOME": str(root), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})


@pytest.fixture
def tree(tmp_path):
    """A git work tree holding a package ``ctl`` (its HEAD commit), importable from tmp_path."""
    pkg = tmp_path / "ctl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "serial.py").write_text("from ctl import util\nVALUE = 1\n")
    (pkg / "util.py").write_text("def f():\n    return 2\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "x")
    return tmp_path


def check(tree, monkeypatch):
    monkeypatch.syspath_prepend(str(tree))
    # -I drops PYTHONPATH: the fresh interpreter gets the tree on sys.path explicitly
    monkeypatch.setattr(provenance, "CLOSURE", f"import sys; sys.path.insert(0, {str(tree)!r})\n" + provenance.CLOSURE)
    return check_control_code(("ctl.serial",), full_distributions=(), git_reference=str(tree), records={})


def modified(report):
    return [f for f in report.findings() if f["check"] == "control-code-modified"]


def test_blob_sha_is_git_hash_object(tree):
    path = tree / "ctl" / "util.py"
    out = subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True, check=True).stdout.strip()
    assert git_blob_sha(str(path)) == out


def test_an_unmodified_tree_passes(tree, monkeypatch):
    report = check(tree, monkeypatch)
    assert report.ok and report.modified == [] and modified(report) == []
    assert report.checked == 3  # ctl/__init__, serial, util
    head = GitReference.find(str(tree)).head
    assert report.summary()["reference"] == f"git HEAD {head}"


def test_a_modified_file_in_the_closure_is_named(tree, monkeypatch):
    (tree / "ctl" / "util.py").write_text("def f():\n    return 3\n")
    report = check(tree, monkeypatch)
    (m,) = report.modified
    assert m["path"] == str(tree / "ctl" / "util.py") and m["reference"].startswith("git HEAD ")
    assert m["expected"] != m["actual"]
    (f,) = modified(report)
    assert f["severity"] == "fail" and "util.py" in f["message"]


def test_an_untracked_module_loaded_by_the_control_fails(tree, monkeypatch):
    (tree / "ctl" / "extra.py").write_text("X = 1\n")
    (tree / "ctl" / "serial.py").write_text("from ctl import util, extra\nVALUE = 1\n")
    report = check(tree, monkeypatch)
    paths = {m["path"]: m for m in report.modified}
    assert paths[str(tree / "ctl" / "extra.py")]["actual"] == "untracked file"
    assert str(tree / "ctl" / "serial.py") in paths


def test_a_file_against_its_record(tmp_path):
    """A library file is checked against the RECORD sha256 (here a map pointing at a temporary copy)."""
    path = tmp_path / "lib.py"
    path.write_bytes(b"x = 1\n")
    good = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(b"x = 1\n").digest()).rstrip(b"=").decode()
    records = {str(path): (good, "RECORD lib 1.0")}
    report = provenance.ProvenanceReport()
    assert provenance.check_file(str(path), None, records, report) == "RECORD lib 1.0" and report.ok
    path.write_bytes(b"x = 2\n")
    provenance.check_file(str(path), None, records, report)
    assert report.modified[0]["expected"] == good and report.modified[0]["reference"] == "RECORD lib 1.0"


def test_startup_code_is_reported(tmp_path):
    (tmp_path / "a.pth").write_text("import os\n")
    (tmp_path / "sitecustomize.py").write_text("")
    (tmp_path / "owned.pth").write_text("")
    found = provenance.startup_files([str(tmp_path)], {str(tmp_path / "owned.pth"): ("sha256=x", "RECORD d 1")})
    assert {(s["kind"], s["owner"]) for s in found} == {("pth", None), ("sitecustomize", None), ("pth", "RECORD d 1")}
    report = provenance.ProvenanceReport(startup=found)
    (f,) = report.findings()
    assert f["check"] == "control-startup-code" and f["severity"] == "warn" and len(f["paths"]) == 2


def test_the_real_control_is_unchanged():
    """The checkout at HEAD and the installed torch and transformers: the closure of the real
    control, every file hashed (what the retime and the harness run)."""
    summary, found, modules = control_code_header()
    assert summary["checked"] > 1000 and summary["reference"].startswith("git HEAD ")
    assert [f for f in found if f["check"] == "control-code-modified"] == [], summary["modified"]
    assert summary["unproven"] == [] and "decoders.serial" in modules


def test_the_work_tree_is_that_of_the_files_the_closure_loaded(tree, tmp_path_factory, monkeypatch):
    """The anchor this process finds (here another git work tree, as a PYTHONPATH or the current
    directory would give it) is not where the isolated interpreter loads the control from: the
    files are checked against the work tree that holds them."""
    other = tmp_path_factory.mktemp("other")
    (other / "f").write_text("x")
    git(other, "init", "-q")
    git(other, "add", ".")
    git(other, "commit", "-qm", "x")
    monkeypatch.setattr(provenance, "CLOSURE", f"import sys; sys.path.insert(0, {str(tree)!r})\n" + provenance.CLOSURE)
    report = check_control_code(("ctl.serial",), full_distributions=(), git_reference=str(other), records={})
    # records={}: the interpreter's own site files (an editable install's finder) have no reference here
    assert report.ok and [u for u in report.unverified if u.startswith(str(tree))] == [] and report.checked == 3
    assert report.summary()["reference"] == f"git HEAD {GitReference.find(str(tree)).head}"
    assert report.modules["ctl.serial"] == str(tree / "ctl" / "serial.py")


def test_the_controls_own_files_no_reference_covers_are_a_warning_naming_them(tmp_path, monkeypatch):
    """The control's own package outside any work tree and RECORD: not proven, a warning naming
    it. Another library no reference covers (a virtualenv's ``_virtualenv.py``, say) is listed
    as unverified only."""
    pkg = tmp_path / "ctl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "serial.py").write_text("import shim\nVALUE = 1\n")
    (tmp_path / "shim.py").write_text("")
    monkeypatch.setattr(provenance, "GitReference", type("NoGit", (GitReference,), {"find": classmethod(lambda c, d: None)}))
    monkeypatch.setattr(provenance, "CLOSURE", f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n" + provenance.CLOSURE)
    report = check_control_code(("ctl.serial",), full_distributions=(), records={})
    ours = [str(pkg / "__init__.py"), str(pkg / "serial.py")]
    assert report.ok and sorted(report.unproven) == ours and str(tmp_path / "shim.py") in report.unverified
    (f,) = [f for f in report.findings() if f["check"] == "control-code-unverified"]
    assert f["severity"] == "warn" and "2 file(s) of the control's own packages" in f["message"]
    assert "not proven unchanged" in f["message"] and f["paths"] == report.unproven
    assert report.summary()["unproven"] == report.unproven


def test_a_module_loaded_here_from_another_file_is_named():
    from types import SimpleNamespace

    modules = {"ctl.serial": "/a/ctl/serial.py", "ctl.util": "/a/ctl/util.py", "gone": "/a/gone.py"}
    here = {"ctl.serial": SimpleNamespace(__file__="/b/ctl/serial.py"), "ctl.util": SimpleNamespace(__file__="/a/ctl/util.py"),
            "builtin": SimpleNamespace()}
    (m,) = provenance.loaded_elsewhere(modules, here)
    assert (m["path"], m["expected"], m["actual"]) == ("/b/ctl/serial.py", "/a/ctl/serial.py", "/b/ctl/serial.py")
    assert "ctl.serial" in m["reference"]
    assert provenance.loaded_elsewhere({"ctl.util": "/a/ctl/util.py"}, here) == []


def test_modules_that_hide_their_file_are_still_checked(tree, monkeypatch):
    """Untracked code that deletes its own ``__file__`` (and ``__spec__``), as planted startup
    code may, is found through its spec or the path finder and named."""
    (tree / "ctl" / "hidden.py").write_text("del __file__\n")
    (tree / "shade.py").write_text("del __file__, __spec__\n")
    (tree / "ctl" / "serial.py").write_text("from ctl import util, hidden\nimport shade\nVALUE = 1\n")
    report = check(tree, monkeypatch)
    paths = {m["path"]: m["actual"] for m in report.modified}
    assert paths[str(tree / "ctl" / "hidden.py")] == "untracked file"
    assert paths[str(tree / "shade.py")] == "untracked file"
