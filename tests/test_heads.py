"""heads train on tiny (CPU): pipeline end to end, backbone untouched, report, refusal and
--force-save paths, load_head round trip, disjoint splits, clear errors."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from harness.models import load_model
from harness.prompts import load_prompts
from heads import load_head
from heads import train as T
from heads.cli import main

ARGS = ["--model", "tiny", "--prompts", "dev", "-n", "16", "--depth", "3", "--device", "cpu"]


@pytest.fixture(scope="module")
def trained():
    model = load_model("tiny", "cpu")
    before_backbone = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    before_head = {k: v.clone() for k, v in model.mtp.state_dict().items()}
    prompts, _ = load_prompts("dev", model)
    res = T.train_head(model, prompts, max_new_tokens=16, steps=8, lr=3e-3, eval_every=4, depth=3, batch=2)
    return model, prompts, res, before_backbone, before_head


def test_pipeline_runs_and_backbone_is_bit_identical(trained):
    model, _, res, before_backbone, before_head = trained
    after = model.backbone.state_dict()
    assert set(after) == set(before_backbone)
    for k, v in before_backbone.items():
        assert torch.equal(after[k], v), k
    for k, v in model.mtp.state_dict().items():  # the model's own head is not trained in place
        assert torch.equal(before_head[k], v), k
    rep = res["report"]
    assert rep["training"]["steps_run"] == 8
    assert [h["step"] for h in rep["history"]] == [0, 4, 8]
    assert res["state"] is not None and set(res["state"]) == set(model.mtp.state_dict())
    g = rep["generation"]
    assert g["tokens"] > 0 and g["seconds"] > 0 and g["prompts"] == 10


def test_report_has_before_and_after_per_depth(trained):
    rep = trained[2]["report"]
    for name in ("before", "after"):
        ev = rep[name]["heldout"]
        assert [d["depth"] for d in ev["per_depth"]] == [1, 2, 3]
        assert ev["mean_accepted_length"] >= 1.0
        assert ev["positions"] > 0
    assert rep["before"]["step"] == 0 and rep["after"]["step"] in (4, 8)
    best = max(h["heldout"]["mean_accepted_length"] for h in rep["history"][1:])
    assert rep["after"]["heldout"]["mean_accepted_length"] == best  # selected by held-out MAL
    json.dumps(rep, allow_nan=False)


def test_splits_never_overlap(trained):
    model, prompts, res, *_ = trained
    s = res["report"]["splits"]
    ids = [set(s[k]) for k in ("train", "dev", "heldout")]
    assert all(ids)
    assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    assert set().union(*ids) == {p.id for p in prompts}
    # stable: same split whatever the order of the prompt file
    again = T.split_prompts(list(reversed(prompts)))
    assert {k: [p.id for p in v] for k, v in again.items()} == s


def test_save_and_load_head_round_trip(trained, tmp_path):
    from safetensors.torch import load_file

    model, _, res, *_ = trained
    T.save_head(tmp_path, res["state"], res["shortlist"], res["report"])
    raw = load_file(str(tmp_path / "mtp.safetensors"))
    assert set(raw) == {"mtp." + k for k in model.mtp.state_dict()}
    head = load_head(model, tmp_path)
    for k, v in head.state_dict().items():
        assert v.dtype == model.mtp.state_dict()[k].dtype
        assert torch.equal(v, raw["mtp." + k]), k
        assert torch.equal(v, res["state"][k]), k
    assert head is not model.mtp
    sl = json.loads((tmp_path / "draft_shortlist.json").read_text())
    assert len(sl["ids"]) == sl["size"] == model.vocab_size


def test_loaded_head_drives_spec_exactly(trained, tmp_path):
    """A saved head is usable by spec beside the unchanged backbone (and spec stays exact)."""
    from decoders.fast_serial import FastSerialDecoder
    from decoders.spec import SpecDecoder

    model, prompts, res, *_ = trained
    T.save_head(tmp_path, res["state"], res["shortlist"], res["report"])
    m2 = dataclasses.replace(model, mtp=load_head(model, tmp_path))
    spec, ser = SpecDecoder(depth=3), FastSerialDecoder()
    spec.prepare(m2)
    ser.prepare(model)
    p = prompts[0].token_ids
    assert spec.decode(p, 16).tokens == ser.decode(p, 16).tokens


def test_refuses_when_not_better_then_force_save(tmp_path, capsys):
    out = tmp_path / "refused"
    # lr 0: the trained head equals the starting one, so it is not better
    rc = main(["train", *ARGS, "--steps", "2", "--eval-every", "2", "--lr", "0", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "not better than the starting head" in err and "--force-save" in err
    assert not (out / "mtp.safetensors").exists() and not (out / "report.json").exists()

    out2 = tmp_path / "forced"
    rc = main(["train", *ARGS, "--steps", "2", "--eval-every", "2", "--lr", "0", "--force-save", "--out", str(out2)])
    assert rc == 0
    rep = json.loads((out2 / "report.json").read_text())
    assert rep["forced"] is True and rep["improved"] is False
    assert rep["before"]["heldout"]["per_depth"] and rep["after"]["heldout"]["per_depth"]
    model = load_model("tiny", "cpu")
    head = load_head(model, out2)
    for k, v in head.state_dict().items():  # lr 0: identical to the starting head
        assert torch.equal(v, model.mtp.state_dict()[k]), k


def _err(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    return [line for line in err if line.startswith("error:")]


def test_clear_errors(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["train", "--model", "tiny", "--prompts", str(empty), "--device", "cpu",
                 "--out", str(tmp_path / "o")]) == 2
    assert len(_err(capsys)) == 1

    afile = tmp_path / "file"
    afile.write_text("x")
    assert main(["train", *ARGS, "--out", str(afile)]) == 2
    assert "not a directory" in _err(capsys)[0]

    two = tmp_path / "two.jsonl"
    two.write_text('{"id": "a", "token_ids": [1, 2, 3]}\n{"id": "b", "token_ids": [4, 5]}\n')
    assert main(["train", "--model", "tiny", "--prompts", str(two), "--device", "cpu",
                 "--out", str(tmp_path / "o2")]) == 2
    assert "at least 3 prompts" in _err(capsys)[0]

    assert main(["train", *ARGS, "--steps", "0", "--out", str(tmp_path / "o3")]) == 2
    assert "--steps" in _err(capsys)[0]
    assert not (tmp_path / "o3").exists()


def test_model_without_mtp_head(tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    from harness.models import TINY_DIR

    ck = tmp_path / "nomtp"
    shutil.copytree(TINY_DIR, ck)
    for f in ck.glob("*.safetensors"):
        sd = load_file(str(f))
        save_file({k: v for k, v in sd.items() if not k.startswith("mtp.")}, str(f), metadata={"format": "pt"})
    idx = ck / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    data["weight_map"] = {k: v for k, v in data["weight_map"].items() if not k.startswith("mtp.")}
    idx.write_text(json.dumps(data))
    rc = main(["train", "--model", str(ck), "--prompts", "dev", "--device", "cpu", "--out", str(tmp_path / "o")])
    assert rc == 2
    errs = _err(capsys)
    assert len(errs) == 1 and "no MTP head" in errs[0]
    assert not (tmp_path / "o").exists()


def test_spec_loads_a_trained_head_by_decoder_arg(trained, tmp_path):
    """`harness time --decoder spec --decoder-arg head=DIR`: spec drafts with the saved head and its
    shortlist, the header records the head's sha256, the run is exact, and the model the harness
    loaded (backbone and its own head, hence its identity) is untouched."""
    import json

    from click.testing import CliRunner

    from harness.cli import main as harness_main

    model, _, res, *_ = trained
    T.save_head(tmp_path / "head", res["state"], res["shortlist"], res["report"])
    out = tmp_path / "run"
    r = CliRunner().invoke(harness_main, ["time", "--model", "tiny", "--decoder", "spec", "--decoder-arg",
                                          f"head={tmp_path / 'head'}", "--limit", "2", "-n", "12", "--legs", "1",
                                          "--out", str(out)])
    assert r.exit_code == 0, r.output
    header = json.loads((out / "stream.jsonl").read_text().splitlines()[0])
    cfg = header["candidate"]["config"]
    assert cfg["head"] == str(tmp_path / "head") and len(cfg["head_sha256"]) == 64
    assert cfg["shortlist"].endswith("draft_shortlist.json")
    assert header["model"]["weights_fingerprint"] == model.identity["weights_fingerprint"]
    legs = [json.loads(x) for x in (out / "stream.jsonl").read_text().splitlines()]
    legs = [x for x in legs if x["type"] == "leg"]
    for pid in {x["prompt_id"] for x in legs}:
        ctl, cand = [x["tokens"] for x in legs if x["prompt_id"] == pid]
        assert ctl == cand

    bad = CliRunner().invoke(harness_main, ["time", "--model", "tiny", "--decoder", "spec", "--decoder-arg",
                                            f"head={tmp_path / 'nowhere'}", "--limit", "1", "-n", "4",
                                            "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "no such head file" in bad.output and "Traceback" not in bad.output
    assert not (tmp_path / "bad" / "stream.jsonl").exists()
