"""`audit tokens --sampling SPEC`: outputs that claim a seeded sampler are judged against serial
decoding under it (CPU, tiny). Serial's sampled tokens pass; the same tokens judged greedy, or
under another seed, fail at their first wrong position; a line that records its sampler is judged
under it, and an explicit --sampling that says otherwise is refused."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from audit.cli import main as audit_main
from core.records import append_record, generation_record
from core.sampling import Sampler
from decoders.serial import SerialDecoder

SPEC = "temperature=0.6,top_k=20,top_p=0.95,seed=5"
N = 24


@pytest.fixture(scope="module")
def serial(tiny):
    dec = SerialDecoder()
    dec.prepare(tiny)
    return dec


@pytest.fixture(scope="module")
def outputs(tiny_tokenizer, serial):
    """(prompt ids, sampled tokens) of two prompts, serial under SPEC."""
    sampler = Sampler.parse(SPEC)
    prompts = [tiny_tokenizer.encode(t) for t in ("The river ran", "def add(a, b):")]
    return [(ids, serial.decode(ids, N, sampler=sampler).tokens) for ids in prompts]


def write_plain(path, outputs):
    """shape (a) lines without a sampler of their own: the claim is --sampling's"""
    path.write_text("".join(json.dumps({"id": f"g{i}", "prompt_token_ids": ids, "output_token_ids": toks}) + "\n"
                            for i, (ids, toks) in enumerate(outputs)))
    return path


def audit(path, *args):
    out = path.parent / "audit_tokens.json"
    if out.exists():
        out.unlink()
    res = CliRunner().invoke(audit_main, ["tokens", str(path), "--model", "tiny", "--device", "cpu",
                                          "--out", str(out), *args])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res, json.loads(out.read_text()) if out.exists() else None


def first_wrong(got, want):
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)


def test_serial_sampled_tokens_pass_with_their_sampler(outputs, tmp_path):
    res, doc = audit(write_plain(tmp_path / "gen.jsonl", outputs), "--sampling", SPEC)
    assert res.exit_code == 0, res.output
    assert doc["verdict"] == "exact" and doc["counts"]["exact"] == len(outputs)
    assert doc["sampler"] == Sampler.parse(SPEC).to_json()
    assert "sampler: temperature=0.6,top_k=20,top_p=0.95,seed=5" in res.output


@pytest.mark.parametrize("other", [None, "temperature=0.6,top_k=20,top_p=0.95,seed=6"])
def test_the_same_tokens_fail_greedy_or_with_another_seed(outputs, tmp_path, serial, other):
    """Judged greedy (the default) or under seed 6, each output fails at the first position where
    its tokens leave that control's own stream."""
    res, doc = audit(write_plain(tmp_path / "gen.jsonl", outputs), *(("--sampling", other) if other else ()))
    assert res.exit_code == 1, res.output
    sampler = Sampler.parse(other) if other else None
    for (ids, toks), entry in zip(outputs, doc["generations"]):
        want = serial.decode(ids, N, sampler=sampler).tokens
        pos = first_wrong(toks, want)
        assert pos is not None
        d = entry["first_divergence"]
        assert not entry["exact"] and d["position"] == pos
        assert (d["emitted"], d["greedy"]) == (toks[pos], want[pos])
        assert d["reason"] == ("emitted token is not the sampler's pick" if other else "emitted token is not the argmax")
        assert d["class"] == "real"


def test_a_line_that_records_its_sampler_is_judged_under_it_and_another_claim_is_refused(outputs, tmp_path):
    path = tmp_path / "record.jsonl"
    sampler = Sampler.parse(SPEC)
    for i, (ids, toks) in enumerate(outputs):
        append_record(path, generation_record(f"r{i}", ids, toks, N, "serial", "tiny", sampler))
    assert json.loads(path.read_text().splitlines()[0])["sampler"] == sampler.to_json()
    for args in (("--sampling", SPEC), ()):
        res, doc = audit(path, *args)
        assert res.exit_code == 0 and doc["verdict"] == "exact", res.output
        assert all(g["sampler"] == sampler.to_json() for g in doc["generations"])
    for other in ("temperature=0.6,top_k=20,top_p=0.95,seed=6", "greedy"):
        res, doc = audit(path, "--sampling", other)
        assert res.exit_code == 2 and doc is None
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert lines[-1].startswith("error:") and "records the sampler" in lines[-1], res.output
        assert "leave --sampling out" in lines[-1]


def test_greedy_and_sampled_lines_of_one_record_file_are_each_judged_under_their_own(outputs, serial, tmp_path):
    """What ``harness generate --record`` leaves after a greedy and a sampled run: one command audits
    both, a greedy line is never judged as a sample; a wrong token is reported against the pick."""
    path = tmp_path / "answers.jsonl"
    (ids, sampled), _ = outputs
    greedy = serial.decode(ids, N).tokens
    append_record(path, generation_record("greedy", ids, greedy, N, "serial", "tiny"))
    append_record(path, generation_record("sampled", ids, sampled, N, "serial", "tiny", Sampler.parse(SPEC)))
    assert json.loads(path.read_text().splitlines()[0])["sampler"]["temperature"] == 0
    res, doc = audit(path)
    assert res.exit_code == 0 and doc["verdict"] == "exact", res.output
    assert [Sampler.from_json(g["sampler"]).greedy for g in doc["generations"]] == [True, False]
    header = next(line for line in res.output.splitlines() if line.startswith("id "))
    assert header.split()[-1] == "sampler", res.output  # mixed samplers: each line names its own
    wrong = sampled[:3] + [(sampled[3] + 1) % 100] + sampled[4:]
    append_record(path, generation_record("wrong", ids, wrong, N, "serial", "tiny", Sampler.parse(SPEC)))
    res, doc = audit(path)
    assert res.exit_code == 1, res.output
    assert doc["generations"][2]["first_divergence"]["position"] == 3
    assert [g["exact"] for g in doc["generations"]] == [True, True, False]
    assert any("vs pick" in line for line in res.output.splitlines()), res.output


@pytest.mark.parametrize("spec", ["temperature=-0.1", "bogus", "top_k=1.5"])
def test_bad_sampling_spec_is_one_error_line(outputs, tmp_path, spec):
    res, doc = audit(write_plain(tmp_path / "gen.jsonl", outputs), "--sampling", spec)
    assert res.exit_code == 2 and doc is None
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --sampling"), res.output


def test_a_bad_recorded_sampler_is_one_error_line(outputs, tmp_path):
    ids, toks = outputs[0]
    path = tmp_path / "gen.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": ids, "output_token_ids": toks,
                                "sampler": {"name": "gumbel-max/v2", "temperature": "hot"}}) + "\n")
    res, doc = audit(path)
    assert res.exit_code == 2 and doc is None
    assert "'sampler'" in res.output
