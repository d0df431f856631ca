"""The draft shortlist: built offline from generated text, sized as asked, found beside a checkpoint."""
import json
import shutil

import pytest

from core.errors import UserError
from core.models import TINY_DIR, load_model
from core.prompts import load_prompts
from decoders.shortlist import build, main
from decoders.spec import SpecDecoder


def test_build_sizes_and_fills(tiny):
    prompts, _ = load_prompts("dev", tiny, limit=2)
    data = build(tiny, prompts, 16, 300)
    ids = data["ids"]
    assert len(ids) == 300 == len(set(ids)) and all(0 <= t < tiny.vocab_size for t in ids)
    assert data["distinct_generated"] <= data["generated_tokens"] == 32
    # the most frequent generated tokens come first; the fill is the lowest unseen ids, in order
    fill = ids[data["distinct_generated"]:]
    assert fill == sorted(fill)


def test_cli_writes_file_and_spec_finds_it_beside_checkpoint(tmp_path, tiny):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(TINY_DIR, ckpt)
    assert main(["--model", str(ckpt), "-n", "8", "--size", "128", "--out", str(ckpt / "draft_shortlist.json")]) == 0
    assert len(json.loads((ckpt / "draft_shortlist.json").read_text())["ids"]) == 128
    model = load_model(str(ckpt), "cpu")
    spec = SpecDecoder(depth=2)
    spec.prepare(model)
    assert spec.drafter.shortlist is not None and spec.drafter.head_weight.shape[0] == 128
    assert spec.config()["shortlist"].endswith("draft_shortlist.json")
    plain = SpecDecoder(depth=2)
    plain.prepare(tiny)  # a built-in: no shortlist unless given
    assert plain.drafter.shortlist is None


def test_cli_rejects_bad_size(tmp_path, capsys):
    assert main(["--model", "tiny", "--size", "0", "--out", str(tmp_path / "s.json")]) == 2
    assert "error:" in capsys.readouterr().err and not (tmp_path / "s.json").exists()


def test_bad_shortlist_files_are_user_errors(tmp_path, tiny):
    cases = {"missing.json": None, "broken.json": "{", "empty.json": "[]", "words.json": '{"ids": ["a"]}',
             "outside.json": json.dumps({"ids": [1, tiny.vocab_size]})}
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(UserError, match=name):
            SpecDecoder(depth=2, shortlist=str(path)).prepare(tiny)


def test_cli_checks_out_and_device_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import core.models

    monkeypatch.setattr(core.models, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    mine = tmp_path / "mine.json"
    mine.write_text("my notes")
    for argv, words in ((["--out", str(mine)], "exists; pass --force"), (["--out", str(tmp_path)], "is a directory"),
                        (["--out", "/proc/x.json"], "cannot write under"),
                        (["--out", str(tmp_path / "s.json"), "--device", "gpu"], "is not available"),
                        (["-n", "0", "--out", str(tmp_path / "s.json")], "must be >= 1")):
        assert main(["--model", "tiny", *argv]) == 2
        assert words in capsys.readouterr().err
    assert mine.read_text() == "my notes"
