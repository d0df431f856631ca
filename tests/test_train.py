"""The small-model training pipeline (core/corpus.py, the training package) on a CPU.

The corpus split is by file, deterministic, and never overlaps; a ``--smoke`` run writes a
checkpoint that the real loader loads, decodes and drafts with; the head's training forward is the
inference head's forward; the acceptance measurement is what a head cache does.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import pytest
import torch
import torch.nn.functional as F

from core import corpus as corpus_mod
from training import cli
from training.acceptance import acceptance_runs, summarize_acceptance
from training.data import SPECIAL, fixed_windows
from training.model import PRESETS, add_dropout, build_models, losses, mtp_rows, text_config
from training.quality import heldout_prompts, loops
from training.train import lr_at, plan_steps, train
from training.unloop import greedy_continuations, repeat_mask, unlikelihood

# --------------------------------------------------------------------------- corpus


@pytest.fixture(scope="module")
def stdlib_corpus():
    return corpus_mod.collect()


def test_split_never_overlaps_and_covers_every_file(stdlib_corpus):
    paths = {s: {f.path for f in stdlib_corpus.split(s)} for s in corpus_mod.SPLITS}
    assert all(paths.values()), "every split has files"
    assert not paths["train"] & paths["dev"]
    assert not paths["train"] & paths["heldout"]
    assert not paths["dev"] & paths["heldout"]
    assert set().union(*paths.values()) == {f.path for f in stdlib_corpus.files}
    assert len(stdlib_corpus.files) == len({f.path for f in stdlib_corpus.files})
    for f in stdlib_corpus.files:
        assert f.split == corpus_mod.split_of(f.path)
        assert f.sha256 == hashlib.sha256(f.text.encode()).hexdigest() and f.size == len(f.text.encode())
    assert [f.path for f in stdlib_corpus.files] == sorted(f.path for f in stdlib_corpus.files)


def test_split_is_deterministic(stdlib_corpus):
    again = corpus_mod.collect()
    assert again.manifest() == stdlib_corpus.manifest()
    # the rule is a pure function of the relative path, pinned so that it cannot drift silently
    assert corpus_mod.split_of("argparse.py") == "train"
    assert corpus_mod.split_of("difflib.py") == "dev"
    assert corpus_mod.split_of("enum.py") == "heldout"
    buckets = [corpus_mod.split_of(f"m{i}.py") for i in range(4000)]
    assert 0.03 < buckets.count("heldout") / 4000 < 0.07 and 0.03 < buckets.count("dev") / 4000 < 0.07


def test_manifest_records_version_and_files(stdlib_corpus):
    m = stdlib_corpus.manifest()
    assert m["python_version"].count(".") == 2
    assert len(m["files"]) == len(stdlib_corpus.files)
    assert all(set(f) == {"path", "split", "bytes", "sha256"} for f in m["files"])
    assert sum(t["bytes"] for t in m["totals"].values()) <= m["max_bytes"]
    assert len(m["files_sha256"]) == 64


def test_exclusion_rules(tmp_path):
    files = {
        "a.py": "x = 1\n",
        "pkg/b.py": "def f():\n    return 2\n",
        "test/test_x.py": "pass\n",
        "pkg/tests/c.py": "pass\n",
        "idlelib/d.py": "pass\n",
        "turtledemo/e.py": "pass\n",
        "test_top.py": "pass\n",
        "_sysconfigdata__linux.py": "build = {}\n",
        "config-3.12-x86_64/f.py": "pass\n",
        "encodings/cp9.py": '""" Python Character Mapping Codec cp9 generated from X.TXT """\n',
        "empty.py": "\n",
        "notes.txt": "text\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "latin.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    (tmp_path / "link.py").symlink_to(tmp_path / "a.py")
    got = corpus_mod.collect(tmp_path)
    assert [f.path for f in got.files] == ["a.py", "pkg/b.py"]
    assert got.skipped["content_rule"] == 3  # codec table, empty, not UTF-8
    capped = corpus_mod.collect(tmp_path, max_bytes=len(files["a.py"]))
    assert [f.path for f in capped.files] == ["a.py"]


def test_subset_keeps_splits_and_budgets(stdlib_corpus):
    sub = stdlib_corpus.subset({"train": 50_000, "dev": 10_000, "heldout": 10_000})
    for s, budget in (("train", 50_000), ("dev", 10_000), ("heldout", 10_000)):
        assert 0 < sum(f.size for f in sub.split(s)) <= budget
        assert all(f.split == s for f in sub.split(s))


# --------------------------------------------------------------------------- the head's training forward


@pytest.fixture(scope="module")
def smoke_models():
    p = PRESETS["smoke"]
    cfg = text_config(p, [2, 0], 0)
    backbone, head = build_models(cfg, seed=3)
    with torch.no_grad():  # non-trivial norms, so that a swapped or skipped norm shows
        for m in (backbone, head):
            for name, q in m.named_parameters():
                if q.ndim == 1 and "norm" in name:
                    q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(len(name))) * 0.2)
    return backbone.eval(), head.eval()


@torch.no_grad()
def test_training_forward_is_the_inference_head(smoke_models):
    """Row t of the training forward = MTPHead.forward fed one row at a time through its cache, as
    at inference: (post-norm h_t, token t+1) at position t, after rows 0..t-1."""
    from core.mtp import new_mtp_cache

    backbone, head = smoke_models
    ids = torch.randint(3, 512, (2, 13), generator=torch.Generator().manual_seed(0))
    hidden, out = mtp_rows(backbone, head, ids)
    T = ids.shape[1]
    assert out.shape == (2, T - 2, hidden.shape[-1])
    assert torch.equal(hidden, backbone.model(input_ids=ids).last_hidden_state)  # after the final norm
    for b in range(2):
        cache = new_mtp_cache(head)
        rows = [head(hidden[b:b + 1, t:t + 1], ids[b:b + 1, t + 1:t + 2], torch.tensor([t]), backbone, cache=cache)
                for t in range(T - 2)]
        torch.testing.assert_close(torch.cat(rows, 1), out[b:b + 1], atol=1e-5, rtol=1e-4)
    # and the loss targets token t+2 from row t
    ntp, mtp = losses(backbone, head, ids)
    V = backbone.config.vocab_size
    want = torch.stack([F.cross_entropy(backbone.lm_head(out[:, t]).float(), ids[:, t + 2]) for t in range(T - 2)])
    torch.testing.assert_close(mtp, want.mean(), atol=1e-5, rtol=1e-5)
    logits = backbone(input_ids=ids).logits
    torch.testing.assert_close(ntp, F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), ids[:, 1:].reshape(-1)))


def test_hidden_reaches_the_backbone_unless_detached(smoke_models):
    backbone, head = smoke_models
    ids = torch.randint(3, 512, (1, 10), generator=torch.Generator().manual_seed(1))
    for detach, expect in ((False, True), (True, False)):
        backbone.zero_grad(set_to_none=True)
        _, out = mtp_rows(backbone, head, ids, detach_hidden=detach)
        out.sum().backward()
        g = backbone.model.layers[0].mlp.down_proj.weight.grad
        assert (g is not None and g.abs().sum() > 0) == expect
    backbone.zero_grad(set_to_none=True)
    head.zero_grad(set_to_none=True)


def test_dropout_hooks_act_in_training_only(smoke_models):
    backbone, head = smoke_models
    ids = torch.randint(3, 512, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = backbone.model(input_ids=ids).last_hidden_state
    handles = add_dropout([backbone, head], 0.5)
    try:
        assert len(handles) == 2 * (backbone.config.num_hidden_layers + 1)
        with torch.no_grad():
            assert torch.equal(backbone.model(input_ids=ids).last_hidden_state, ref)
            backbone.train()
            assert not torch.equal(backbone.model(input_ids=ids).last_hidden_state, ref)
    finally:
        backbone.eval()
        for h in handles:
            h.remove()


# --------------------------------------------------------------------------- training loop


def _tiny_run(steps, minutes=None, **changes):
    p = dataclasses.replace(PRESETS["smoke"], eval_every=1000, log_every=1000, **changes)
    cfg = text_config(p, [2, 0], 0)
    backbone, head = build_models(cfg, seed=5)
    stream = torch.randint(3, 512, (4000,), generator=torch.Generator().manual_seed(5))
    dev = fixed_windows(stream[:512], p.seq_len, 4)
    return train(backbone, head, stream, dev, p, steps, torch.device("cpu"), 5, minutes)


def test_training_is_deterministic():
    a, b = _tiny_run(4), _tiny_run(4)
    assert a.steps_done == b.steps_done == 4 and a.best_step == 4
    for sa, sb in zip(a.best_state, b.best_state):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_auto_plan_fits_the_time_cap():
    r = _tiny_run(None, minutes=0.05, calib_steps=12, warmup=13, max_epochs=1000.0, seq_len=32, batch=2)
    assert r.plan["rule"].endswith("time cap") and r.plan["seconds_per_step"] > 0
    fast = dataclasses.replace(PRESETS["smoke"], max_epochs=1000.0, seq_len=32, batch=2)
    assert r.plan["steps"] <= plan_steps(fast, 4000)
    assert r.steps_done <= r.plan["steps"] and r.stopped_by in ("steps", "time")
    untimed = _tiny_run(None, max_epochs=0.2)
    assert untimed.plan == {"rule": "0.2 epochs", "steps": plan_steps(
        dataclasses.replace(PRESETS["smoke"], max_epochs=0.2), 4000)} and untimed.steps_done == untimed.plan["steps"]


def test_lr_schedule():
    p = PRESETS["smoke"]
    assert lr_at(0, p, 100) == pytest.approx(p.lr / p.warmup)
    assert lr_at(p.warmup - 1, p, 100) == pytest.approx(p.lr)
    assert lr_at(99, p, 100) == pytest.approx(p.lr * p.min_lr_frac, rel=0.01)
    assert all(lr_at(s, p, 100) >= lr_at(s + 1, p, 100) for s in range(p.warmup, 99))


def test_loop_check():
    assert loops([1, 2, 3] * 20) and loops([7] * 40)
    assert not loops(list(range(40))) and not loops([1, 2] * 5)


# --------------------------------------------------------------------------- the --smoke run


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("small") / "ckpt"
    report = cli.main(["--smoke", "--out", str(out), "--device", "cpu"])
    return out, report


@pytest.fixture(scope="module")
def smoke_model(smoke):
    from core.models import load_model

    return load_model(str(smoke[0]), "cpu")


def test_smoke_checkpoint_is_in_the_released_layout(smoke):
    from safetensors import safe_open

    out, _ = smoke
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and cfg["model_type"] == "qwen3_5"
    text = cfg["text_config"]
    assert text["model_type"] == "qwen3_5_text" and text["layer_types"].count("full_attention") * 4 == len(
        text["layer_types"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    keys = set()
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / shard), framework="pt") as fh:
            keys |= set(fh.keys())
            assert all(fh.get_tensor(k).dtype == torch.bfloat16 for k in fh.keys())
    assert keys == set(index["weight_map"])
    assert "lm_head.weight" in keys and "model.language_model.embed_tokens.weight" in keys
    assert any(k.startswith("mtp.layers.0.self_attn.") for k in keys) and "mtp.fc.weight" in keys
    assert all(k.startswith(("model.language_model.", "lm_head.", "mtp.")) for k in keys)
    gen = json.loads((out / "generation_config.json").read_text())
    tok = json.loads((out / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert gen["eos_token_id"] == [added["<|im_end|>"], added["<|endoftext|>"]]
    assert set(added) == set(SPECIAL)
    for name in ("tokenizer_config.json", "corpus_manifest.json", "quality.json"):
        assert (out / name).is_file()


def test_smoke_checkpoint_loads_and_decodes(smoke, smoke_model):
    from decoders.serial import SerialDecoder

    m = smoke_model
    assert m.mtp is not None and m.identity["layout"] == "multimodal"
    assert m.vocab_size == PRESETS["smoke"].vocab
    tok = m.tokenizer.get()
    prompt = tok.encode("def read(self, path):\n    ")
    dec = SerialDecoder()
    dec.prepare(m)
    result = dec.decode(prompt, 10)
    assert 1 <= len(result.tokens) <= 10 and all(0 <= t < m.vocab_size for t in result.tokens)


def test_checkpoint_tokenizer_encodes_as_training_did(smoke, smoke_model, stdlib_corpus):
    """transformers' Qwen2Tokenizer rebuilds its pre-tokenizer; the trained BPE must use that same one."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(smoke[0] / "tokenizer.json"))
    hf = smoke_model.tokenizer.get()
    for f in stdlib_corpus.split("heldout")[:3]:
        text = f.text[:4000]
        assert hf.encode(text) == raw.encode(text, add_special_tokens=False).ids
        assert hf.decode(hf.encode(text)) == text


def test_quality_report(smoke):
    out, report = smoke
    q = json.loads((out / "quality.json").read_text())
    assert q == json.loads(json.dumps(report))
    for key in ("corpus", "tokenizer", "model", "training", "dev", "heldout", "acceptance", "spec_check", "samples",
                "repetition", "determinism", "versions"):
        assert key in q, key
    p = PRESETS["smoke"]
    assert math.isfinite(q["heldout"]["ntp_loss"]) and math.isfinite(q["heldout"]["mtp_loss"])
    assert q["heldout"]["ntp_bits_per_byte"] > 0
    acc = q["acceptance"]
    assert [d["depth"] for d in acc["per_depth"]] == list(range(1, p.depth + 1))
    assert all(0.0 <= d["conditional"] <= 1.0 for d in acc["per_depth"])
    assert set(acc["tokens_per_round_at_fixed_depth"]) == {str(d) for d in range(1, p.depth + 1)}
    assert q["spec_check"]["exact_vs_serial"] is True
    # the simulation of a fixed-depth round and the real spec decoder agree on the same streams
    assert acc["tokens_per_round_at_fixed_depth"][str(p.depth)] == pytest.approx(
        q["spec_check"]["mean_accepted_length"], abs=0.05)
    assert len(q["samples"]) == p.samples and all({"prompt", "greedy", "reference"} <= set(s) for s in q["samples"])
    assert q["training"]["steps_done"] == p.steps and q["training"]["stopped_by"] == "steps"
    assert q["model"]["checkpoint_bytes"] == sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert q["corpus"]["files_sha256"] == json.loads((out / "corpus_manifest.json").read_text())["files_sha256"]
    # held-out was never trained on: no held-out file is in the train split of the manifest
    manifest = json.loads((out / "corpus_manifest.json").read_text())
    held = {f["path"] for f in manifest["files"] if f["split"] == "heldout"}
    assert held and not held & {f["path"] for f in manifest["files"] if f["split"] == "train"}
    assert all(s["path"] in held for s in q["samples"])
    dev_rep = q["dev_repetition"]
    assert dev_rep["streams"] > 0 and 0.0 <= dev_rep["looping_fraction"] <= 1.0
    assert 0.0 <= dev_rep["reference_looping_fraction"] <= 1.0
    assert 0.0 <= q["repetition"]["reference_looping_fraction"] <= 1.0


def test_measure_only_reproduces_the_runs_own_quality(smoke):
    """Re-measuring a checkpoint gives the figures its training run measured (same splits, prompts,
    loop check), so a shipped model and a new variant can be compared on one measure."""
    out, report = smoke
    again = cli.main(["--smoke", "--out", str(out), "--device", "cpu", "--measure-only", "--no-spec-check"])
    assert json.loads((out / "quality.remeasured.json").read_text()) == json.loads(json.dumps(again))
    for key in ("dev", "heldout", "repetition", "dev_repetition", "samples"):
        assert again[key] == json.loads(json.dumps(report[key])), key
    assert again["files_sha256"] == report["corpus"]["files_sha256"]


def test_measure_only_refuses_a_directory_that_is_not_a_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--smoke", "--out", str(tmp_path), "--device", "cpu", "--measure-only"])
    assert "not a checkpoint" in capsys.readouterr().err and exc.value.code == 2


def test_training_knobs_reach_the_preset_and_bad_ones_are_refused(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "run", lambda out, preset, *a, **k: seen.setdefault("preset", preset))
    cli.main(["--smoke", "--out", "/nonexistent", "--device", "cpu", "--dropout", "0.2", "--weight-decay", "0.3",
              "--max-epochs", "12"])
    p = seen["preset"]
    assert (p.dropout, p.weight_decay, p.max_epochs) == (0.2, 0.3, 12.0)
    for bad in (["--dropout", "1.0"], ["--weight-decay", "-1"], ["--max-epochs", "0"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["--smoke", "--out", "/nonexistent", *bad])
        assert exc.value.code == 2


def _reference_runs(model, prompts, streams, depth):
    """Acceptance by brute force: for every position a fresh head cache, fed teacher rows 0..t in one
    causal call, then chained; one prompt at a time."""
    from core.mtp import new_mtp_cache

    lm, head = model.backbone, model.mtp
    out_rows = []
    for p, s in zip(prompts, streams):
        seq = torch.tensor([p + s])
        H = lm.model(input_ids=seq).last_hidden_state
        row = []
        for t in range(len(p) - 1, len(p) + len(s) - 2):
            cache = new_mtp_cache(head)
            o = head(H[:, : t + 1], seq[:, 1: t + 2], torch.arange(t + 1), lm, cache=cache)[:, -1:]
            tok = lm.lm_head(o).argmax(-1)
            run, k = 0, 1
            while True:
                if t + 1 + k >= seq.shape[1] or int(tok) != int(seq[0, t + 1 + k]):
                    break
                run += 1
                if k == depth:
                    break
                o = head(o, tok, torch.tensor([t + k]), lm, cache=cache)
                tok = lm.lm_head(o).argmax(-1)
                k += 1
            row.append(run)
        out_rows.append(row)
    return out_rows


@torch.inference_mode()
def test_acceptance_matches_brute_force(smoke, smoke_model, stdlib_corpus):
    from decoders.serial import SerialDecoder
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(smoke[0] / "tokenizer.json"))
    prompts = [q["ids"] for q in heldout_prompts(stdlib_corpus.split("heldout"), raw, 3, 1, 12, 10)]
    dec = SerialDecoder()
    dec.prepare(smoke_model)
    streams = [dec.decode(q, 10).tokens for q in prompts]
    # plus a stream the head's first drafts always predict (each token t+2 is the head's draft from
    # row t), so that accepted runs, and chains past depth 1, are exercised
    lm, head = smoke_model.backbone, smoke_model.mtp
    seq = list(prompts[0]) + [streams[0][0]]
    for _ in range(9):
        ids = torch.tensor([seq])
        H = lm.model(input_ids=ids).last_hidden_state
        o = head(H[:, :-1], ids[:, 1:], torch.arange(len(seq) - 1), lm)
        seq.append(int(lm.lm_head(o[:, -1]).argmax(-1)))
    prompts.append(prompts[0])
    streams.append(seq[len(prompts[0]):])
    A, lens = acceptance_runs(smoke_model.backbone, smoke_model.mtp, prompts, streams, depth=3)
    want = _reference_runs(smoke_model, prompts, streams, depth=3)
    for i, row in enumerate(want):
        got = [int(x) for x in A[i] if x >= 0]
        assert got == row
    assert min(want[-1]) >= 1  # the constructed stream accepts every first draft
    summary = summarize_acceptance(A, lens, 12, 3)
    assert summary["positions"] == sum(len(r) for r in want)
    assert summary["per_depth"][0]["accepted"] == sum(r >= 1 for row in want for r in row)


def test_make_tiny_output_unchanged(tmp_path):
    """make_tiny's writer is shared with training.export; the committed tiny fixture must stay byte-identical."""
    from fixtures import make_tiny
    from core.models import TINY_DIR

    make_tiny.write(tmp_path)
    written = sorted(tmp_path.iterdir())
    assert len(written) >= 6
    for f in written:
        assert f.read_bytes() == (TINY_DIR / f.name).read_bytes(), f.name


# --------------------------------------------------------------------------- the unlikelihood fine-tune


def test_repeat_mask_marks_tokens_that_complete_a_seen_ngram():
    seq = torch.tensor([[1, 2, 3, 9, 1, 2, 3, 4, 2, 3]])
    m = repeat_mask(seq, start=4, n=2)
    # from position 4: (9,1) new, (1,2) seen, (2,3) seen, (3,4) new, (4,2) new, (2,3) seen
    assert m[0].tolist() == [False] * 4 + [False, True, True, False, False, True]
    assert not repeat_mask(seq, start=4, n=5).any()


def test_greedy_continuations_are_the_uncached_argmax(smoke_models):
    """The cached batched generation the fine-tune trains on continues each row with the argmax of a
    full forward over that row (CPU, fp32)."""
    backbone, _ = smoke_models
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, backbone.config.vocab_size, (3, 10), generator=gen)
    seq = greedy_continuations(backbone, prompts, 6, amp=False)
    assert seq.shape == (3, 16) and torch.equal(seq[:, :10], prompts)
    with torch.no_grad():
        for t in range(10, 16):
            full = backbone(input_ids=seq[:, :t], use_cache=False).logits[:, -1]
            assert torch.equal(full.argmax(-1), seq[:, t])


def test_unloop_lowers_the_probability_of_a_repeat(smoke_models):
    """A few unlikelihood updates on a looping sequence lower p(repeat token) there."""
    import copy

    backbone, head = (copy.deepcopy(m) for m in smoke_models)
    seq = torch.tensor([[5, 6, 7, 8] * 6])
    mask = repeat_mask(seq, 4, 4)
    assert mask[0, 7:].all()

    def p_repeat():
        with torch.no_grad():
            logits = backbone(input_ids=seq, use_cache=False).logits[0, 3:-1].float()
        return logits.softmax(-1).gather(-1, seq[0, 4:, None]).mean().item()

    before = p_repeat()
    opt = torch.optim.SGD(backbone.parameters(), lr=0.5)
    for _ in range(5):
        backbone.zero_grad()
        unlikelihood(backbone, seq, mask, 4).backward()
        opt.step()
    assert p_repeat() < before


def test_unloop_run_records_its_rounds(tmp_path):
    out = tmp_path / "u"
    report = cli.main(["--smoke", "--out", str(out), "--device", "cpu", "--unloop-steps", "4", "--no-spec-check"])
    u = report["training"]["unloop"]
    assert u["updates"] == 4 and len(u["rounds"]) == 2 and u["settings"]["unloop_steps"] == 4
    assert all(0.0 <= r["looping_fraction"] <= 1.0 and r["mean_unlikelihood"] >= 0.0 for r in u["rounds"])
    again = cli.main(["--smoke", "--out", str(tmp_path / "v"), "--device", "cpu", "--init-from", str(out),
                      "--unloop-steps", "2", "--no-spec-check"])
    t = again["training"]
    assert t["steps_done"] == 0 and t["init_from"]["path"] == str(out) and t["unloop"]["updates"] == 2
    # starting from an exported checkpoint begins where that run's unlikelihood phase ended
    assert t["unloop"]["dev_before"]["ntp_loss"] == pytest.approx(u["dev_after"]["ntp_loss"], abs=0.02)
    with pytest.raises(SystemExit):
        cli.main(["--smoke", "--out", str(out), "--init-from", str(out), "--unloop-steps", "1"])
