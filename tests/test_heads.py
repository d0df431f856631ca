"""heads train on tiny (CPU): pipeline end to end, backbone untouched, report, refusal and
--force-save paths, load_head round trip, disjoint splits, clear errors."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from core.models import load_model
from core.prompts import load_prompts
from decoders.drafter import load_head
from heads import train as T
from heads.cli import main

ARGS = ["--model", "tiny", "--prompts", "dev", "-n", "16", "--depth", "3", "--device", "cpu"]


@pytest.fixture(scope="module")
def trained():
    model = load_model("tiny", "cpu")
    before_backbone = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    before_head = {k: v.clone() for k, v in model.mtp.state_dict().items()}
    prompts, _ = load_prompts("dev", model)
    res = T.train_head(model, prompts, T.HeadTrainConfig(max_new_tokens=16, steps=8, lr=3e-3, eval_every=4, depth=3,
                                                         batch=2))
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
    umask = os.umask(0o022)
    try:
        T.save_head(tmp_path, res["state"], res["shortlist"], res["report"])
    finally:
        os.umask(umask)
    # safetensors writes its file private to its owner; the head's files are all as a plain open makes them
    assert {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {
        T.HEAD_FILE: 0o644, T.SHORTLIST_FILE: 0o644, T.REPORT_FILE: 0o644}
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

    assert main(["train", *ARGS, "--gen-batch", "0", "--out", str(tmp_path / "o4")]) == 2
    assert "--gen-batch" in _err(capsys)[0]
    assert main(["train", *ARGS, "--max-heldout", "0", "--out", str(tmp_path / "o5")]) == 2
    assert "--max-heldout" in _err(capsys)[0]


def test_model_without_mtp_head(tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    from core.models import TINY_DIR

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
                                          "--device", "cpu", "--out", str(out)])
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
                                            "--device", "cpu", "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "no such head file" in bad.output and "Traceback" not in bad.output
    assert not (tmp_path / "bad" / "stream.jsonl").exists()


# --------------------------------------------------------------------------- generation for more data


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", "cpu")


def test_pipeline_generates_train_batched_and_dev_heldout_exactly(trained):
    g = trained[2]["report"]["generation"]
    assert g["train"]["decoder"] == "hf-batched" and g["train"]["exact"] is False
    assert g["dev"]["decoder"] == g["heldout"]["decoder"] == "fast-serial"
    for k in ("train", "dev", "heldout"):
        assert g[k]["tokens"] > 0 and g[k]["seconds"] > 0 and g[k]["tokens_per_s"] > 0
    assert g["tokens"] == sum(g[k]["tokens"] for k in ("train", "dev", "heldout"))
    pt = g["train"]["prompt_tokens"]
    assert pt["used"] <= pt["original"] and pt["truncated_prompts"] == len(g["train"]["truncated"])


def test_batched_generation_lengths_and_equal_length_groups(tiny):
    prompts, _ = load_prompts("dev", tiny)
    used, streams, cost = T.generate_batched(tiny, prompts, 6, batch=4)
    assert [p.id for p in used] == [p.id for p in prompts] and len(streams) == len(prompts)
    eos = set(tiny.eos_token_ids)
    for p, u, s in zip(prompts, used, streams):
        assert p.token_ids[-len(u.token_ids):] == u.token_ids  # left-truncated: a suffix of the prompt
        assert 1 <= len(s) <= 6 and (len(s) == 6 or s[-1] in eos) and not eos & set(s[:-1])
    groups = T.equal_length_batches(prompts, 4)
    assert [len(g) for g in groups] == [4, 4, 2]
    assert all(len({len(p.token_ids) for p in g}) == 1 for g in groups)
    lens = [len(g[0].token_ids) for g in groups]
    assert lens == sorted(lens) and lens[0] == min(len(p.token_ids) for p in prompts)
    assert cost["decoder"] == "hf-batched" and cost["batches"] == 3 and cost["tokens"] == sum(map(len, streams))
    assert cost["prompt_tokens"]["used"] == sum(len(u.token_ids) for u in used)
    for pid, (a, b) in cost["truncated"].items():
        assert a > b
    # a batch of one row is plain greedy on the untruncated prompt: SerialDecoder's stream
    from decoders.serial import SerialDecoder

    ser = SerialDecoder()
    ser.prepare(tiny)
    one_used, one, _ = T.generate_batched(tiny, prompts[:1], 6, batch=1)
    assert one_used[0].token_ids == prompts[0].token_ids
    assert one[0] == ser.decode(prompts[0].token_ids, 6).tokens
    # --gen-dtype float32: a float32 copy generates; the backbone itself stays as it was
    before = {k: v.clone() for k, v in tiny.backbone.state_dict().items()}
    _, s32, c32 = T.generate_batched(tiny, prompts[:4], 6, batch=4, dtype=torch.float32)
    assert c32["dtype"] == "float32" and cost["dtype"] == "bfloat16" and all(1 <= len(s) <= 6 for s in s32)
    assert all(torch.equal(v, before[k]) for k, v in tiny.backbone.state_dict().items())


def test_batched_generation_stops_rows_at_eos(tiny):
    """Make a token row 0 emits at step 3 an EOS: every row stops right after its first occurrence
    (keeping it) and leaves the batch; the rows without it go on to -n tokens, unchanged."""
    prompts, _ = load_prompts("dev", tiny, limit=4)
    n = 8
    _, base, _ = T.generate_batched(tiny, prompts, n, batch=4)
    tok = base[0][3]
    first = [s.index(tok) if tok in s else None for s in base]
    assert any(i is None or i > first[0] for i in first[1:])  # some row outlives row 0
    _, got, cost = T.generate_batched(dataclasses.replace(tiny, eos_token_ids=(tok,)), prompts, n, batch=4)
    assert got == [b if i is None else b[: i + 1] for b, i in zip(base, first)]
    assert got[0][-1] == tok and len(got[0]) <= 4 and max(map(len, got)) > len(got[0])
    assert cost["tokens"] == sum(map(len, got))


def test_generate_splits_dev_and_heldout_are_fast_serial(tiny):
    from decoders.fast_serial import FastSerialDecoder

    prompts, _ = load_prompts("dev", tiny, limit=6)
    splits = T.split_prompts(prompts)
    used, streams, cost = T.generate_splits(tiny, splits, 5, gen_batch=4)
    dec = FastSerialDecoder()
    dec.prepare(tiny)
    for k in ("dev", "heldout"):
        assert used[k] == splits[k]
        assert streams[k] == [dec.decode(p.token_ids, 5).tokens for p in splits[k]]
        assert cost[k]["decoder"] == "fast-serial"
    assert cost["train"]["decoder"] == "hf-batched" and len(streams["train"]) == len(splits["train"])
    # --gen-batch 1: the train split exact too, on its full prompts
    used1, streams1, cost1 = T.generate_splits(tiny, splits, 5, gen_batch=1)
    assert used1["train"] == splits["train"] and cost1["train"]["decoder"] == "fast-serial"
    assert streams1["train"] == [dec.decode(p.token_ids, 5).tokens for p in splits["train"]]


def test_split_caps():
    from types import SimpleNamespace

    ps = [SimpleNamespace(id=f"p{i}") for i in range(100)]
    s = T.split_prompts(ps)
    assert [len(s[k]) for k in ("heldout", "dev", "train")] == [20, 10, 70]
    c = T.split_prompts(ps, max_heldout=7, max_dev=3)
    assert [len(c[k]) for k in ("heldout", "dev", "train")] == [7, 3, 90]
    assert [p.id for p in c["heldout"]] == [p.id for p in s["heldout"][:7]]  # a cap keeps a prefix of the order


def test_corpus_prompt_sets_take_a_count(tiny, monkeypatch):
    base, info = load_prompts("stdlib-dev", tiny)
    assert len(base) == 32 and info["source"] == "builtin:stdlib-dev"
    few, _ = load_prompts("stdlib-dev:3", tiny)
    more, info = load_prompts("stdlib-dev:40", tiny)
    assert [p.id for p in few] == [p.id for p in base[:3]]
    assert [p.token_ids for p in more[:32]] == [p.token_ids for p in base]  # a larger N extends the set
    assert len(more) == 40 and len({p.id for p in more}) == 40 and len({p.text for p in more}) == 40
    assert info["source"] == "builtin:stdlib-dev:40"
    # --limit takes the first prompts of the same set: the set's digest, only those tokenized
    calls = []
    encode = tiny.tokenizer.get().encode
    monkeypatch.setattr(tiny.tokenizer.get(), "encode", lambda text: calls.append(text) or encode(text))
    first, first_info = load_prompts("stdlib-dev:40", tiny, limit=2)
    assert [p.token_ids for p in first] == [p.token_ids for p in more[:2]] and len(calls) == 2
    assert first_info["sha256"] == info["sha256"] and first_info["count"] == 2


@pytest.mark.parametrize("spec,needle", [
    ("stdlib-train:0", "integer within"), ("stdlib-train:-2", "integer within"), ("stdlib-train:x", "integer within"),
    ("stdlib-train:", "integer within"), ("stdlib-train:1.5", "integer within"), ("dev:3", "takes no count"),
    ("stdlib-train:999999999", "integer within 1..100000"),
    ("random-512:4", "takes no count"), ("no-such-set", "not a built-in prompt set"),
])
def test_bad_prompt_set_specs_are_user_errors(tiny, spec, needle, tmp_path, capsys):
    from core.errors import UserError

    with pytest.raises(UserError, match=needle):
        load_prompts(spec, tiny)
    assert main(["train", "--model", "tiny", "--prompts", spec, "--device", "cpu", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len([x for x in err.splitlines() if x.startswith("error:")]) == 1
    assert not (tmp_path / "o").exists()


def test_fit_keeps_the_best_evaluation_and_stops_once_dev_loss_stalls(monkeypatch):
    """Selection by held-out mean accepted length, early stopping by dev loss alone: dev loss
    improves at step 2, then fails to at steps 4 and 6 (patience 2), so step 6 is the last step
    run, while the best held-out figure (step 4's) is the one kept."""
    monkeypatch.setattr(T, "train_step", lambda *args: 0.5)
    evals = {2: (0.8, 2.0), 4: (0.9, 3.0), 6: (0.85, 2.5), 8: (0.1, 9.0)}
    head = torch.nn.Linear(2, 2)

    def held(step):
        dev_loss, mal = evals[step]
        head.weight.data.fill_(step)  # the state kept must be the best step's
        return {"step": step, "dev_loss": dev_loss, "heldout": {"mean_accepted_length": mal}}

    before = {"step": 0, "dev_loss": 1.0, "heldout": {"mean_accepted_length": 1.0}}
    run = T.fit(head, None, [], held, before, T.HeadTrainConfig(steps=8, eval_every=2, patience=2), torch.float32)
    assert (run.steps, run.stopped_early) == (6, True)
    assert [r["step"] for r in run.history] == [0, 2, 4, 6]
    assert run.best["step"] == 4 and run.best_state["weight"].eq(4).all()
    assert all(r["train_loss"] == 0.5 for r in run.history[1:])


def test_fit_without_dev_rows_never_stops_early(monkeypatch):
    monkeypatch.setattr(T, "train_step", lambda *args: 0.0)
    run = T.fit(torch.nn.Linear(2, 2), None, [], lambda step: {"step": step, "dev_loss": None,
                                                               "heldout": {"mean_accepted_length": None}},
                {"step": 0, "dev_loss": None, "heldout": {"mean_accepted_length": None}},
                T.HeadTrainConfig(steps=5, eval_every=1, patience=1), torch.float32)
    assert (run.steps, run.stopped_early, len(run.history)) == (5, False, 6)
