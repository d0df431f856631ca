"""`heads` at the command line: click options with help and defaults, --version, bad input as
one `error:` line before anything loads (an --out that is the model's own directory, or that
cannot really be written, included), a write that fails at the end as one line and exit 2, and
Ctrl-C as one line and exit 130, with no partial head directory or stray directory left behind."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import core.models
import core.paths
from heads import cli
from heads import train as T
from heads.run import EXIT_INTERRUPTED, model_dir_of

ARGS = ["--model", "tiny", "--prompts", "dev", "-n", "4", "--device", "cpu"]


def _errors(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.strip()]


def test_every_option_has_help_and_a_default_or_is_required():
    for cmd in (cli.heads, cli.train_cmd):
        for p in cmd.params:
            if p.name in ("help", "version"):
                continue
            assert p.help, p.name
            assert p.required or p.show_default, p.name


def test_help_and_version(capsys):
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for opt in ("--model", "--prompts", "--out", "--device", "--gen-batch", "--force-save", "default: 200"):
        assert opt in out
    for argv in (["--version"], ["train", "--version"]):
        assert cli.main(argv) == 0
        assert capsys.readouterr().out.startswith("qwen35-exact ")


@pytest.mark.parametrize("argv, words", [
    (["train", "--model", "tiny", "--prompts", "dev"], "Missing option '--out'"),
    (["train", *ARGS, "--out", "o", "--steps", "zero"], "--steps"),
    (["train", *ARGS, "--out", "o", "--gen-dtype", "float16"], "--gen-dtype"),
    (["nope"], "No such command"),
])
def test_usage_errors_are_one_line(argv, words, capsys):
    assert cli.main(argv) == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0] and "--help" in lines[0]


@pytest.mark.parametrize("device", ["gpu", "mps", "cuda:99", "cpu:0"])
def test_bad_device_is_refused_before_the_model_loads(device, tmp_path, capsys, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(core.models, "load_model", no_load)
    out = tmp_path / "o"
    assert cli.main(["train", "--model", "tiny", "--prompts", "dev", "--device", device, "--out", str(out)]) == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: --device ") and repr(device) in lines[0]
    assert "cpu" in lines[0] and not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_cuda_without_a_gpu(tmp_path, capsys):
    assert cli.main(["train", "--model", "tiny", "--prompts", "dev", "--device", "cuda",
                     "--out", str(tmp_path / "o")]) == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and "no CUDA GPU" in lines[0]


def test_nonexistent_model(tmp_path, capsys):
    assert cli.main(["train", "--model", str(tmp_path / "nowhere"), "--prompts", "dev", "--device", "cpu",
                     "--out", str(tmp_path / "o")]) == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and "neither a built-in" in lines[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", [T.HEAD_FILE, T.SHORTLIST_FILE, T.REPORT_FILE])
def test_out_holding_a_head_file_is_refused_and_kept(name, tmp_path, capsys):
    (tmp_path / name).write_text("the user's")
    assert cli.main(["train", *ARGS, "--out", str(tmp_path)]) == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and "already holds" in lines[0] and name in lines[0]
    assert (tmp_path / name).read_text() == "the user's"


def test_ctrl_c_while_training_is_one_line_and_130(tmp_path, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(T, "train_head", interrupted)
    out = tmp_path / "o"
    assert cli.main(["train", *ARGS, "--out", str(out)]) == EXIT_INTERRUPTED == 130
    assert _errors(capsys) == ["error: interrupted; nothing was written"]
    assert not out.exists()


def _fake_result(model) -> dict:
    report = {"selected_step": 1, "generation": {"tokens": 0, "seconds": 0.0, "prompts": 0,
              **{k: {"tokens": 0, "seconds": 0.0, "tokens_per_s": None, "decoder": "x"}
                 for k in ("train", "dev", "heldout")}}}
    return {"report": report, "state": dict(model.mtp.state_dict()), "improved": True,
            "shortlist": {"ids": [0, 1], "size": 2}}


@pytest.mark.parametrize("stage", ["head", "report", "rename"])
def test_ctrl_c_while_saving_leaves_no_partial_head(stage, tmp_path, capsys, monkeypatch):
    """Interrupted while the head's own file, the report or the final renames are written:
    exit 130, one line, and no head file, no temporary file."""
    monkeypatch.setattr(T, "train_head", lambda model, prompts, cfg: _fake_result(model))
    monkeypatch.setattr(T, "summary_lines", lambda report: [])
    if stage == "head":
        def half_written(tensors, path, metadata=None):
            with open(path, "wb") as fh:
                fh.write(b"\0" * 64)
            raise KeyboardInterrupt
        monkeypatch.setattr(T, "save_file", half_written)
    elif stage == "report":
        real = T._json_text
        monkeypatch.setattr(T, "_json_text", lambda obj: real(obj) if "size" in obj else _raise())
    else:
        real_replace = Path.replace

        def replace(self, target):  # the head file is the last rename: interrupt it
            if Path(target).name == T.HEAD_FILE:
                raise KeyboardInterrupt
            return real_replace(self, target)
        monkeypatch.setattr(Path, "replace", replace)
    out = tmp_path / "o"
    assert cli.main(["train", *ARGS, "--out", str(out)]) == 130
    lines = _errors(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: interrupted")
    left = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert T.HEAD_FILE not in left and not [n for n in left if n.endswith(".tmp")]
    if left:  # renamed before the interrupt: said so
        assert "no head" in lines[0] and all(n in lines[0] for n in left)
    else:
        assert lines[0] == "error: interrupted; nothing was written"


def _raise():
    raise KeyboardInterrupt


def test_save_head_round_trip_leaves_only_its_files(tmp_path):
    model = core.models.load_model("tiny", "cpu")
    res = _fake_result(model)
    T.save_head(tmp_path, res["state"], res["shortlist"], res["report"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([T.HEAD_FILE, T.SHORTLIST_FILE, T.REPORT_FILE])
    assert json.loads((tmp_path / T.REPORT_FILE).read_text())["selected_step"] == 1


# --------------------------------------------------------------------------- --out refused before training

def _no_training(monkeypatch):
    """The refusals below come before the model loads: fail loudly (and write nothing) if not."""
    def no_load(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(core.models, "load_model", no_load)
    monkeypatch.setattr(T, "train_head", no_load)


def _tree(path: Path) -> dict:
    return {p.relative_to(path).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*")}


@pytest.mark.parametrize("model", ["tiny", "small"])
@pytest.mark.parametrize("spelling", ["fixtures/{m}", "fixtures/{m}/", "./fixtures/{m}", "fixtures/../fixtures/{m}",
                                      "ABS", "ABS/", "LINK"])
def test_out_that_is_a_builtin_models_own_directory_is_refused(model, spelling, tmp_path, capsys, monkeypatch):
    _no_training(monkeypatch)
    model_dir = core.models.COMMITTED[model]
    monkeypatch.chdir(model_dir.parent.parent)  # the repository root, where fixtures/ is
    if spelling == "LINK":
        out = tmp_path / "link"
        out.symlink_to(model_dir, target_is_directory=True)
        out = str(out)
    else:
        out = spelling.replace("ABS", str(model_dir)).format(m=model)
    before = _tree(model_dir)
    assert cli.main(["train", "--model", model, "--prompts", "dev", "--device", "cpu", "--out", out]) == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: --out ") and "checkpoint directory" in lines[0]
    assert _tree(model_dir) == before
    assert not any((model_dir / n).exists() for n in (T.HEAD_FILE, T.SHORTLIST_FILE, T.REPORT_FILE))


def test_out_that_is_a_model_directory_given_by_path_is_refused(capsys, monkeypatch):
    _no_training(monkeypatch)
    tiny = core.models.TINY_DIR
    monkeypatch.chdir(tiny.parent.parent)
    before = _tree(tiny)
    assert cli.main(["train", "--model", str(tiny), "--prompts", "dev", "--device", "cpu",
                     "--out", "./fixtures/tiny/"]) == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and "checkpoint directory" in lines[0]
    assert _tree(tiny) == before


def test_model_dir_of_builtins():
    assert model_dir_of("tiny") == core.models.TINY_DIR and model_dir_of("small") == core.models.SMALL_DIR
    assert model_dir_of("synthetic-9b") is None  # built on the GPU, never on disk: nothing to refuse
    assert model_dir_of("some/dir") == Path("some/dir")


@pytest.mark.parametrize("below", [("sub",), ("sub", "deeper")])
def test_out_below_a_file_is_refused_before_training(below, tmp_path, capsys, monkeypatch):
    """A path under a regular file cannot be made even by root (ENOTDIR)."""
    _no_training(monkeypatch)
    (tmp_path / "afile").write_text("the user's")
    out = tmp_path.joinpath("afile", *below)
    assert cli.main(["train", *ARGS, "--out", str(out)]) == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: --out ") and "not writable" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    assert (tmp_path / "afile").read_text() == "the user's"


@pytest.mark.skipif(not Path("/sys/kernel").is_dir() or Path("/sys/h").exists(), reason="needs Linux sysfs")
def test_out_on_sysfs_is_refused_before_training(capsys, monkeypatch):
    """os.access says yes to root here; the probe does not."""
    _no_training(monkeypatch)
    assert cli.main(["train", *ARGS, "--out", "/sys/h"]) == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: --out '/sys/h' is not writable")
    assert not Path("/sys/h").exists()


@pytest.mark.parametrize("existing", [False, True])
def test_unwritable_out_leaves_no_directory_and_keeps_the_users(existing, tmp_path, capsys, monkeypatch):
    """A directory that refuses new files (read-only mount, as root too), simulated: the probe's
    file cannot be made. Directories made for the probe go again; one the user had stays, with its files."""
    _no_training(monkeypatch)

    def refused(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(core.paths, "open", refused, raising=False)  # the probe file cannot be made
    if existing:
        out = tmp_path / "mine"
        out.mkdir()
        (out / "notes.txt").write_text("the user's")
    else:
        out = tmp_path / "new" / "deep"
    assert cli.main(["train", *ARGS, "--out", str(out)]) == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and lines[0] == f"error: --out {str(out)!r} is not writable: Permission denied"
    if existing:
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    else:
        assert list(tmp_path.iterdir()) == []


def test_probe_leaves_nothing_behind(tmp_path):
    from heads.run import probe_writable

    probe_writable(tmp_path)
    probe_writable(tmp_path / "to" / "be" / "made")
    probe_writable(tmp_path / "x" / ".." / "y")  # "x/.." exists once x is made
    assert list(tmp_path.iterdir()) == []


def test_not_saved_leaves_no_directory(tmp_path, capsys, monkeypatch):
    def not_better(model, prompts, cfg):
        return {**_fake_result(model), "improved": False}

    monkeypatch.setattr(T, "train_head", not_better)
    monkeypatch.setattr(T, "summary_lines", lambda report: [])
    out = tmp_path / "o"
    assert cli.main(["train", *ARGS, "--out", str(out)]) == 1
    assert not out.exists()


# --------------------------------------------------------------------------- a failed write at the end

def _fail_head(monkeypatch, exc):
    def failing(tensors, path, metadata=None):
        raise exc
    monkeypatch.setattr(T, "save_file", failing)


def _fail_report(monkeypatch, exc):
    real = Path.write_text

    def write_text(self, *a, **k):
        if self.name.startswith(f".{T.REPORT_FILE}"):
            raise exc
        return real(self, *a, **k)
    monkeypatch.setattr(Path, "write_text", write_text)


def _fail_head_rename(monkeypatch, exc):  # the shortlist and report are already in place
    real = Path.replace

    def replace(self, target):
        if Path(target).name == T.HEAD_FILE:
            raise exc
        return real(self, target)
    monkeypatch.setattr(Path, "replace", replace)


@pytest.mark.parametrize("fail", [_fail_head, _fail_report, _fail_head_rename])
@pytest.mark.parametrize("exc, words", [(OSError(28, "No space left on device"), "No space left on device"),
                                        (PermissionError(13, "Permission denied"), "Permission denied")])
@pytest.mark.parametrize("existing", [False, True])
def test_failed_write_is_one_line_exit_2_and_leaves_nothing(fail, exc, words, existing, tmp_path, capsys,
                                                            monkeypatch):
    monkeypatch.setattr(T, "train_head", lambda model, prompts, cfg: _fake_result(model))
    monkeypatch.setattr(T, "summary_lines", lambda report: [])
    out = tmp_path / "o" / "head"
    if existing:
        out.mkdir(parents=True)
        (out / "notes.txt").write_text("the user's")
    fail(monkeypatch, exc)
    assert cli.main(["train", *ARGS, "--out", str(out)]) == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and lines[0] == f"error: cannot write the head to {out}: {words}; nothing was saved"
    if existing:
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    else:
        assert list(tmp_path.iterdir()) == []


def test_safetensors_write_error_is_one_line(tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError

    monkeypatch.setattr(T, "train_head", lambda model, prompts, cfg: _fake_result(model))
    monkeypatch.setattr(T, "summary_lines", lambda report: [])
    _fail_head(monkeypatch, SafetensorError("Error while serializing: I/O error: Read-only file system (os error 30)"))
    out = tmp_path / "o"
    assert cli.main(["train", *ARGS, "--out", str(out)]) == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: cannot write the head to ") and "Read-only" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_learning_rate_that_is_not_finite_is_a_usage_error_before_any_work(tmp_path, capsys, monkeypatch, value):
    monkeypatch.setattr(core.models, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert cli.main(["train", "--model", "tiny", "--lr", value, "--out", str(tmp_path / "h")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a finite number" in err[0] and not (tmp_path / "h").exists()
