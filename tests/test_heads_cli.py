"""`heads` at the command line: click options with help and defaults, --version, bad input as
one `error:` line before anything loads, and Ctrl-C as one line and exit 130, with no partial
head directory left behind."""
from __future__ import annotations

import json

import pytest
import torch

import core.models
from heads import cli
from heads import train as T
from heads.run import EXIT_INTERRUPTED

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
        from pathlib import Path

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
