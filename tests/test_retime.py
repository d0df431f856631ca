"""``audit retime`` on tiny (CPU pinned): honest streams reproduce; a stream whose candidate legs
were shortened and resealed, and a decoder that precomputes the built-in prompt set in
``prepare()``, both pass ``audit replay`` and are caught by the retime (``ratio-not-reproduced``).

Every retime starts two worker processes (``python -m harness.worker``); tests/ goes on their
PYTHONPATH so that they can import the plug-in decoder.
"""
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from audit_helpers import findings, forge_stream, run_audit, run_harness

TESTS = Path(__file__).resolve().parent
N, PROMPTS, LEGS = 24, 3, 2


@pytest.fixture(autouse=True)
def workers_import_tests(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))


def run_retime(stream: Path, *args: str):
    """Returns (click Result, retime.json document or None)."""
    from audit.cli import main as audit_main

    out = stream.parent / "retime.json"
    result = CliRunner().invoke(audit_main, ["retime", str(stream), "--device", "cpu", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result, json.loads(out.read_text()) if out.exists() else None


@pytest.fixture(scope="session")
def fast_serial_stream(tmp_path_factory):
    return run_harness(tmp_path_factory.mktemp("retime") / "fast", "fast-serial", limit=PROMPTS, n=N, legs=LEGS)


@pytest.mark.parametrize("decoder", ["fast-serial", "spec"])
def test_honest_stream_reproduces(decoder, fast_serial_stream, tmp_path):
    stream = fast_serial_stream if decoder == "fast-serial" else \
        run_harness(tmp_path / decoder, decoder, limit=PROMPTS, n=N, legs=LEGS)
    result, doc = run_retime(stream)
    assert result.exit_code == 0, result.output
    assert doc["verdict"] == "pass" and not findings(doc, "ratio-not-reproduced")
    assert doc["candidate"]["name"] == decoder and doc["kind"] == "retime"
    assert len(doc["prompts"]) == PROMPTS and all(e["exact"] for e in doc["prompts"])
    held = {tuple(r["token_ids"]) for r in map(json.loads, stream.read_text().splitlines())
            if r["type"] == "prompt"}
    by_id = {json.loads(line)["id"]: json.loads(line) for line in stream.read_text().splitlines()
             if json.loads(line)["type"] == "prompt"}
    for e in doc["prompts"]:  # fresh prompts: none of the stream's, each as long as the one it mirrors
        assert tuple(e["token_ids"]) not in held
        assert e["tokens"] == len(by_id[e["mirrors"]]["token_ids"])
    assert "resampled from the stream's own prompt tokens" in doc["fresh_prompts"]  # tiny's set: dev
    assert "recorded" in result.stdout and "retimed" in result.stdout and "retime took" in result.stdout


def test_seed_comes_from_the_stream_bytes(fast_serial_stream, tmp_path):
    """The fresh prompts depend on the file's sha256: the same file draws the same prompts."""
    import hashlib

    from audit.retime import fresh_prompts, stream_seed
    from audit.stream import load_run
    from core.models import load_model

    run, model = load_run(fast_serial_stream), load_model("tiny", "cpu")
    seed = stream_seed(hashlib.sha256(fast_serial_stream.read_bytes()).hexdigest())
    a, how = fresh_prompts(run, model, 2, seed)
    b, _ = fresh_prompts(run, model, 2, seed)
    c, _ = fresh_prompts(run, model, 2, seed + 1)
    assert [p.token_ids for p in a] == [p.token_ids for p in b] != [p.token_ids for p in c]
    assert all(p.warmup_ids != p.token_ids and len(p.warmup_ids) == len(p.token_ids) for p in a)


def test_shortened_candidate_legs_pass_replay_but_not_retime(fast_serial_stream, tmp_path):
    forged = forge_stream(fast_serial_stream, tmp_path / "forged", 0.25)
    result, doc = run_audit(forged)
    timing = [f for f in doc["findings"] if f["severity"] == "fail"]
    assert timing == [] and doc["verdict"] == "pass" and doc["score"] > 0, result.output

    result, doc = run_retime(forged)
    assert result.exit_code == 1, result.output
    (f,) = findings(doc, "ratio-not-reproduced")
    assert f["retimed"] < f["recorded"] * (1 - f["tolerance"])
    assert "ratio-not-reproduced" in result.stdout


def test_precomputed_builtin_prompts_pass_replay_but_not_retime(tmp_path):
    stream = run_harness(tmp_path / "pre", "retime_decoders:Precomputed", limit=PROMPTS, n=N, legs=LEGS)
    result, doc = run_audit(stream)
    assert result.exit_code == 0, result.output
    assert doc["exact"] and doc["median_ratio"] > 5 and doc["score"] > 0.5  # looks like a great decoder

    result, _ = run_retime(stream)  # the stream names code: it runs only when trusted
    assert result.exit_code == 2 and "--trust-plugin" in result.stderr
    assert not (stream.parent / "retime.json").exists()

    result, doc = run_retime(stream, "--trust-plugin")
    assert result.exit_code == 1, result.output
    assert findings(doc, "ratio-not-reproduced") and all(e["exact"] for e in doc["prompts"])
    assert doc["retimed_median_ratio"] < 2 < doc["recorded_median_ratio"]


def test_bad_input_exits_2_and_writes_nothing(fast_serial_stream, tmp_path):
    outdir = tmp_path / "outdir"
    outdir.mkdir()
    result, _ = run_retime(fast_serial_stream, "--out", str(outdir))
    assert result.exit_code == 2 and "is a directory" in result.stderr and list(outdir.iterdir()) == []
    result, doc = run_retime(tmp_path / "missing.jsonl")
    assert result.exit_code == 2 and doc is None and result.stderr.startswith("error:")


def test_recorded_sides_and_their_arguments():
    from audit.retime import recorded_sides
    from audit.stream import BadInput

    header = {"control": {"name": "serial"}, "candidate": {"name": "spec", "spec": "spec", "args": {"depth": 3}},
              "command": ["harness", "time", "--decoder-arg", "depth=2"]}
    control, candidate = recorded_sides(header, trust_plugins=False)
    assert (control.spec, control.args, candidate.spec, candidate.args, candidate.raw_args) == \
        ("serial", {}, "spec", {"depth": 3}, ())
    # no recorded args: the command line's --decoder-arg values go to the worker as they were given
    del header["candidate"]["args"]
    header["command"] += ["--decoder-arg=max_depth=4"]
    candidate = recorded_sides(header, trust_plugins=False)[1]
    assert candidate.raw_args == ("depth=2", "max_depth=4")
    assert candidate.command("tiny", "cpu")[-2:] == ["--decoder-arg=depth=2", "--decoder-arg=max_depth=4"]
    with pytest.raises(BadInput, match="--trust-plugin"):
        recorded_sides({**header, "candidate": {"name": "x", "spec": "os:system"}}, trust_plugins=False)


def test_an_instrument_is_retimed_with_its_untimed_preparation(tmp_path):
    """An instrument makes no scored claim, but its ratio is reproducible: the candidate's worker
    gets the same untimed per-prompt preparation ``harness time`` gives it, and only it."""
    stream = run_harness(tmp_path / "inst", "spec-instrument", limit=2, n=N, legs=LEGS)
    result, doc = run_retime(stream, "--prompts", "2")
    assert result.exit_code == 0, result.output
    assert doc["candidate"]["instrument"] is True and "instrument: never scored" in result.stdout
    assert all(e["exact"] for e in doc["prompts"]) and not findings(doc, "ratio-not-reproduced")


def test_the_worker_refuses_to_prepare_a_decoder_that_is_not_an_instrument():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "harness.worker", "--model", "tiny", "--device", "cpu",
                           "--decoder", "fast-serial"],
                          input=json.dumps({"prepare_prompt": [1, 2, 3], "max_new_tokens": 4}) + "\n",
                          capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines[0]["ready"] is True
    assert "not an instrument" in lines[1]["error"]


@pytest.mark.parametrize("source, how", [("builtin:random-512", "random token ids"),
                                         ("builtin:stdlib-heldout", "other snippets of the heldout split")])
def test_fresh_prompts_come_from_the_stream_source(fast_serial_stream, tmp_path, source, how):
    from audit.retime import fresh_prompts
    from audit.stream import load_run
    from core.models import load_model
    from core.prompts import corpus_prompts

    copy = tmp_path / "stream.jsonl"
    records = [json.loads(line) for line in fast_serial_stream.read_text().splitlines()]
    records[0]["prompts"]["source"] = source
    copy.write_text("".join(json.dumps(r) + "\n" for r in records))
    run, model = load_run(copy), load_model("tiny", "cpu")
    fresh, said = fresh_prompts(run, model, 3, 12345)
    assert how in said
    lengths = {p.id: len(p.token_ids) for p in run.prompts}
    assert [len(p.token_ids) for p in fresh] == [lengths[p.mirrors] for p in fresh]
    if source.endswith("heldout"):  # none is the start of one of the set's own snippets
        tok = model.tokenizer.get()
        own = [tok.encode(e["text"]) for e in corpus_prompts("heldout", 10)]
        assert not any(ids[:len(p.token_ids)] == p.token_ids for p in fresh for ids in own)


def test_worker_that_cannot_start_is_bad_input(fast_serial_stream, tmp_path):
    from audit_helpers import copy_stream, read_records, write_records

    stream = copy_stream(fast_serial_stream, tmp_path / "unknown")
    records = read_records(stream)
    records[0]["candidate"]["spec"] = "no-such-decoder"
    write_records(stream, records)
    result, doc = run_retime(stream)
    assert result.exit_code == 2 and doc is None
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: retime could not start") and "no-such-decoder" in lines[-1]
