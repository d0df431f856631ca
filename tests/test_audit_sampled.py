"""Sampled runs through the real harness and audit on the tiny model: ``harness time --sampling``
records the sampler in the sealed header, both sides decode with it, and ``audit replay`` replays
every leg with it. Honest sampled streams pass; each sampling cheat of tests/bad_decoders.py is
caught at its first wrong token, with its position; a header whose sampler was edited (and the
stream resealed) fails on the tokens themselves."""
import json

import pytest
from click.testing import CliRunner

from audit_helpers import edit, find_leg, findings, first_mismatch, prompt_ids, read_records, run_audit, run_harness
from core.sampling import NAME, Sampler

SPEC = "temperature=0.6,top_k=20,top_p=0.95,seed=3"
# T = 1 over tiny's near-uniform logits with a narrow top-k: every cheat's shortcut changes a token early
CHEAT_SPEC = "temperature=1.0,top_k=5,seed=21"


def sampled_run(tmp_path, decoder, spec=SPEC, *, limit=1, n=12, extra=()):
    return run_harness(tmp_path / "run", decoder, limit=limit, n=n, legs=1, extra=("--sampling", spec, *extra))


@pytest.mark.parametrize("decoder,args", [("fast-serial", ()), ("spec", ("--decoder-arg", "depth=2"))])
def test_honest_sampled_stream_passes_replay(tmp_path, decoder, args):
    stream = sampled_run(tmp_path, decoder, limit=2, n=16, extra=args)
    records = read_records(stream)
    header = records[0]
    assert header["sampler"] == {**Sampler.parse(SPEC).to_json(), "name": NAME}
    result, doc = run_audit(stream)
    assert result.exit_code == 0, result.output
    assert doc["exact"] and doc["verdict"] == "pass"
    # the tokens are the sampler's, not greedy's: the same prompts greedy give other tokens
    greedy = read_records(run_harness(tmp_path / "greedy", decoder, limit=2, n=16, legs=1, extra=args))
    for pid in prompt_ids(records):
        assert find_leg(records, pid, "candidate", 0)["tokens"] == find_leg(records, pid, "control", 0)["tokens"]
    assert any(find_leg(records, pid, "control", 0)["tokens"] != find_leg(greedy, pid, "control", 0)["tokens"]
               for pid in prompt_ids(records))


@pytest.mark.parametrize("cheat", ["OtherSeed", "ShiftedPositions", "DropsFilter", "DraftDistribution"])
def test_sampling_cheat_is_caught_at_its_first_wrong_token(tmp_path, cheat):
    stream = sampled_run(tmp_path, f"bad_decoders:{cheat}", CHEAT_SPEC, n=16)
    records = read_records(stream)
    pid = prompt_ids(records)[0]
    ctl = find_leg(records, pid, "control", 0)["tokens"]
    cand = find_leg(records, pid, "candidate", 0)["tokens"]
    pos = first_mismatch(cand, ctl)
    assert pos is not None, "the cheat happened to be exact here; the test needs a divergence"
    result, doc = run_audit(stream)
    assert result.exit_code == 1, result.output
    (f,) = findings(doc, "exactness")
    assert (f["prompt_id"], f["leg"], f["position"]) == (pid, "candidate#0", pos)
    assert (f["emitted"], f["greedy"]) == (cand[pos], ctl[pos])
    assert f["reason"] == "emitted token is not the sampler's pick"
    assert f"diverges at position {pos}" in f["message"] and "serial sampling" in f["message"]
    assert doc["prompts"][0]["first_divergence"]["position"] == pos
    assert not doc["exact"] and doc["verdict"] == "fail"


@pytest.fixture(scope="module")
def honest_stream(tmp_path_factory):
    return sampled_run(tmp_path_factory.mktemp("honest"), "fast-serial", n=16)


def test_edited_sampler_in_a_resealed_header_fails_replay(honest_stream, tmp_path):
    stream = tmp_path / "stream.jsonl"
    stream.write_bytes(honest_stream.read_bytes())

    def other_seed(records):
        records[0]["sampler"]["seed"] += 1
    records = edit(stream, other_seed)
    result, doc = run_audit(stream)
    assert result.exit_code == 1, result.output
    assert doc["replayed"] and not doc["exact"]
    assert findings(doc, "exactness")  # the tokens, not the seal: the seal was recomputed
    assert not findings(doc, "integrity")
    assert records[0]["sampler"]["seed"] == 4


@pytest.mark.parametrize("sampler", [{"name": "other/v0", "temperature": 0.6}, {"name": NAME, "temperature": -1},
                                     {"name": NAME, "temprature": 0.6}, "temperature=0.6"])
def test_a_header_sampler_that_defines_none_is_bad_input(honest_stream, tmp_path, sampler):
    stream = tmp_path / "stream.jsonl"
    stream.write_bytes(honest_stream.read_bytes())
    edit(stream, lambda records: records[0].__setitem__("sampler", sampler))
    result, doc = run_audit(stream)
    assert result.exit_code == 2 and doc is None
    assert "header sampler" in result.output


def test_old_stream_without_a_sampler_is_greedy(tmp_path):
    stream = run_harness(tmp_path / "run", "fast-serial", limit=1, n=12, legs=1)
    assert "sampler" not in read_records(stream)[0]
    result, doc = run_audit(stream)
    assert result.exit_code == 0 and doc["exact"]


def test_temperature_zero_is_todays_greedy_stream(tmp_path):
    """``--sampling temperature=0`` is greedy: the same tokens as a run without --sampling, the
    same header (no sampler recorded), the same replay."""
    zero = read_records(run_harness(tmp_path / "zero", "spec", limit=2, n=12, legs=1,
                                    extra=("--sampling", "temperature=0,seed=9")))
    plain = read_records(run_harness(tmp_path / "plain", "spec", limit=2, n=12, legs=1))
    assert "sampler" not in zero[0]
    legs = lambda records: [(r["prompt_id"], r["role"], r["tokens"]) for r in records if r["type"] == "leg"]  # noqa: E731
    assert legs(zero) == legs(plain)


def invoke_harness(*args):
    from harness.cli import main as harness_main

    return CliRunner().invoke(harness_main, ["time", "--model", "tiny", "--device", "cpu", "--limit", "1", "-n", "4",
                                             "--legs", "1", *args])


@pytest.mark.parametrize("spec", ["temperature=-1", "top_p=2", "qwen-thinking,bogus=1", "warm", "seed=x", ""])
def test_bad_sampling_spec_is_one_error_line(tmp_path, spec):
    result = invoke_harness("--decoder", "fast-serial", "--out", str(tmp_path / "run"), "--sampling", spec)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --sampling"), result.output
    assert not (tmp_path / "run").exists()


def test_candidate_that_does_not_sample_is_refused(tmp_path):
    result = invoke_harness("--decoder", "spec-naive", "--out", str(tmp_path / "run"), "--sampling", "qwen-thinking")
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("error: the candidate spec-naive does not sample"), result.output
    assert not (tmp_path / "run" / "stream.jsonl").exists()


def test_preset_is_recorded_with_its_numbers(tmp_path):
    stream = sampled_run(tmp_path, "fast-serial", "qwen-instruct,seed=11", n=8)
    header = read_records(stream)[0]
    assert header["sampler"] == {"name": NAME, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": 0.0,
                                 "seed": 11}
    assert json.loads(json.dumps(header["sampler"])) == Sampler.parse("qwen-instruct,seed=11").to_json()


def test_sampled_instrument_stream_is_exact(tmp_path):
    """spec-instrument under a sampler: at alpha 1 every draft is the sampled control's token, so
    every draft is accepted, and the audit finds every token exact (tests/test_harness_sampling.py
    checks that its untimed prepare_prompt is given the sampler)."""
    stream = sampled_run(tmp_path, "spec-instrument", n=16, extra=("--decoder-arg", "alpha=1.0",
                                                                     "--decoder-arg", "depth=3"))
    records = read_records(stream)
    legs = [r for r in records if r["type"] == "leg" and r["role"] == "candidate"]
    assert all(r["stats"]["drafted"] > 0 and r["stats"]["accepted"] == r["stats"]["drafted"] for r in legs)
    result, doc = run_audit(stream)
    assert doc["exact"] and doc["instrument"], result.output
