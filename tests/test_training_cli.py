"""`python -m training` at the command line: click options with help and defaults, --version,
an --out that is not this command's own output refused unless --force (and then only the
checkpoint's own files replaced), the checkpoint moved into place whole, bad --device refused up
front, and Ctrl-C as one line and exit 130."""
from __future__ import annotations

import json

import pytest

from training import cli, outdir, pipeline
from training.outdir import MANIFEST_FILE, replace_checkpoint

SMOKE = ["--smoke", "--device", "cpu", "--no-spec-check"]


def _errors(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.strip()]


@pytest.fixture
def no_run(monkeypatch):
    """Records what cli.main would run, and runs nothing."""
    seen = {}
    monkeypatch.setattr(cli, "run", lambda out, preset, **k: seen.update(out=out, preset=preset, **k) or {"ran": 1})
    return seen


def _earlier_run(d):
    d.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                 "model-00003-of-00003.safetensors", "tokenizer.json", "quality.json", MANIFEST_FILE):
        (d / name).write_text("old " + name)
    return d


def _tree(d) -> dict:
    return {p.name: p.read_text() for p in sorted(d.iterdir())}


# --------------------------------------------------------------------------- options


def test_every_option_has_help_and_a_default_or_is_required():
    for p in cli.command.params:
        if p.name in ("help", "version"):
            continue
        assert p.help, p.name
        assert p.required or p.show_default or p.is_flag, p.name


def test_help_and_version(capsys):
    for argv in (["--help"], ["--version"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--force" in out and "--out DIR" in out and "default: 0" in out
    assert out.rstrip().splitlines()[-1].startswith("qwen35-exact ")


@pytest.mark.parametrize("argv, words", [
    ([], "Missing option '--out'"),
    (["--out", "x", "--steps", "0"], "--steps"),
    (["--out", "x", "--measure-only", "--force"], "--force"),
])
def test_usage_errors_are_one_line(argv, words, capsys, no_run):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0]
    assert not no_run


@pytest.mark.parametrize("device", ["gpu", "mps", "cuda:7"])
def test_bad_device_is_refused_before_any_work(device, tmp_path, capsys, no_run):
    for extra in ([], ["--measure-only"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["--smoke", "--out", str(tmp_path / "o"), "--device", device, *extra])
        assert exc.value.code == 2
        lines = _errors(capsys)
        assert len(lines) == 1 and lines[0].startswith("error: --device ") and repr(device) in lines[0]
    assert not no_run and not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- --out and --force


def test_out_dot_with_foreign_files_is_refused_and_untouched(tmp_path, monkeypatch, capsys, no_run):
    """`--out .` in a checkout: refused, one line, every file as it was."""
    (tmp_path / "README.md").write_text("mine")
    (tmp_path / "config.json").write_text("{}")  # a name a checkpoint uses, but not this command's output
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        cli.main([*SMOKE, "--out", "."])
    assert exc.value.code == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and "not a checkpoint this command wrote" in lines[0] and "--force" in lines[0]
    assert "README.md" in lines[0]
    assert (tmp_path / "README.md").read_text() == "mine" and (tmp_path / "config.json").read_text() == "{}"
    assert (tmp_path / "src" / "a.py").read_text() == "x = 1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json", "src"]
    assert not no_run


def test_other_checkpoints_and_files_are_refused(tmp_path, capsys, no_run):
    hf = tmp_path / "hf"  # a checkpoint of names this command writes, but without its manifest
    hf.mkdir()
    for name in ("config.json", "model-00001-of-00002.safetensors", "tokenizer.json"):
        (hf / name).write_text("theirs")
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, words in ((hf, "not a checkpoint this command wrote"), (afile, "not a directory")):
        with pytest.raises(SystemExit) as exc:
            cli.main([*SMOKE, "--out", str(out)])
        assert exc.value.code == 2
        lines = _errors(capsys)
        assert len(lines) == 1 and words in lines[0]
    assert not no_run and afile.read_text() == "x" and all(p.read_text() == "theirs" for p in hf.iterdir())


def test_new_empty_and_earlier_run_outs_are_accepted(tmp_path, no_run):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new", tmp_path / "empty", _earlier_run(tmp_path / "old")):
        assert cli.main([*SMOKE, "--out", str(out)]) == {"ran": 1}
        assert no_run["out"] == out and no_run["force"] is False
    assert cli.main([*SMOKE, "--out", str(tmp_path), "--force"]) == {"ran": 1} and no_run["force"] is True


def _writer(names, calls=None):
    def write(d):
        if calls is not None:
            calls.append(d)
        for name in names:
            (d / name).write_text("new " + name)
    return write


NEW = ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", MANIFEST_FILE)


def test_replace_checkpoint_new_directory(tmp_path):
    out = tmp_path / "a" / "b"
    replace_checkpoint(out, _writer(NEW), force=False)
    assert _tree(out) == {n: "new " + n for n in sorted(NEW)}
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b"]  # no staging directory left


def test_replace_checkpoint_replaces_an_earlier_run_entirely(tmp_path):
    out = _earlier_run(tmp_path / "old")
    replace_checkpoint(out, _writer(NEW), force=False)
    # the old 3-shard files and quality.json are the old run's: gone; nothing else appears
    assert _tree(out) == {n: "new " + n for n in sorted(NEW)}


def test_replace_checkpoint_forced_keeps_every_other_file(tmp_path):
    (tmp_path / "README.md").write_text("mine")
    (tmp_path / "model-00001-of-00003.safetensors").write_text("theirs")  # not written now: kept
    (tmp_path / "config.json").write_text("theirs")
    (tmp_path / "sub").mkdir()
    with pytest.raises(outdir.UserError):
        replace_checkpoint(tmp_path, _writer(NEW), force=False)
    assert (tmp_path / "config.json").read_text() == "theirs"
    replace_checkpoint(tmp_path, _writer(NEW), force=True)
    tree = {p.name: p.read_text() if p.is_file() else "<dir>" for p in tmp_path.iterdir()}
    assert tree == {"README.md": "mine", "model-00001-of-00003.safetensors": "theirs", "sub": "<dir>",
                    **{n: "new " + n for n in NEW}}


@pytest.mark.parametrize("kind", ["new", "earlier", "forced"])
def test_an_interrupted_export_changes_nothing(kind, tmp_path):
    out = tmp_path / "out"
    if kind == "earlier":
        _earlier_run(out)
    elif kind == "forced":
        out.mkdir()
        (out / "README.md").write_text("mine")
    before = _tree(out) if out.exists() else None

    def half(d):
        (d / "config.json").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replace_checkpoint(out, half, force=kind == "forced")
    assert (_tree(out) if out.exists() else None) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if kind == "new" else ["out"])


def test_unwritable_out_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(outdir.UserError, match="cannot write --out"):
        replace_checkpoint(blocker / "sub" / "out", _writer(NEW), force=False)


# --------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_before_the_export_is_one_line_and_130(tmp_path, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run", interrupted)
    with pytest.raises(SystemExit) as exc:
        cli.main([*SMOKE, "--out", str(tmp_path / "o")])
    assert exc.value.code == 130
    assert _errors(capsys) == ["error: interrupted; nothing was written"]


def test_ctrl_c_in_the_quality_phase_keeps_the_checkpoint_and_says_so(tmp_path, capsys, monkeypatch):
    """A real --smoke run interrupted while measuring: its checkpoint is complete and loads, there
    is no quality.json, and the one line says where the checkpoint is."""
    from core.models import load_model

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "measure_quality", interrupted)
    out = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as exc:
        cli.main([*SMOKE, "--out", str(out)])
    assert exc.value.code == 130
    lines = [x for x in _errors(capsys) if x.startswith("error:")]
    assert lines == [f"error: interrupted while measuring quality; the checkpoint is in {out}, without quality.json"]
    assert not (out / "quality.json").exists() and json.loads((out / MANIFEST_FILE).read_text())["files"]
    assert load_model(str(out), "cpu").mtp is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_init_from_that_is_not_a_checkpoint_is_one_line(tmp_path, capsys, no_run):
    with pytest.raises(SystemExit) as exc:
        cli.main([*SMOKE, "--out", str(tmp_path / "o"), "--init-from", str(tmp_path / "nowhere")])
    assert exc.value.code == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and "not a checkpoint directory" in lines[0]
    assert not no_run and not (tmp_path / "o").exists()


def test_a_written_checkpoint_has_the_permissions_a_plain_open_gives(tmp_path):
    """mkdtemp's directory and safetensors' files are private to their owner; the checkpoint is not."""
    import os

    from safetensors.torch import save_file
    import torch

    def write(stage):
        save_file({"w": torch.zeros(2)}, str(stage / "model-00001-of-00001.safetensors"))
        (stage / "config.json").write_text("{}")

    umask = os.umask(0o022)
    try:
        out = tmp_path / "ckpt"
        replace_checkpoint(out, write, force=False)
        assert out.stat().st_mode & 0o777 == 0o755
        assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {
            "model-00001-of-00001.safetensors": 0o644, "config.json": 0o644}
        outdir.write_text_atomic(out / "quality.json", "{}")
        assert (out / "quality.json").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(umask)


def test_an_out_nothing_can_be_written_under_is_refused_before_any_work(monkeypatch):
    monkeypatch.setattr(cli, "run", lambda *a, **k: pytest.fail("it trained"))
    with pytest.raises(SystemExit) as exc:
        cli.main([*SMOKE, "--out", "/proc/qwen35-x"])
    assert exc.value.code == 2


@pytest.mark.parametrize("option", ["--weight-decay", "--minutes", "--max-epochs", "--unloop-lr"])
def test_a_number_that_is_not_finite_is_a_usage_error(monkeypatch, tmp_path, option):
    monkeypatch.setattr(cli, "run", lambda *a, **k: pytest.fail("it trained"))
    with pytest.raises(SystemExit) as exc:
        cli.main([*SMOKE, "--out", str(tmp_path / "o"), option, "nan"])
    assert exc.value.code == 2
