"""Known-bad decoders (tests/bad_decoders.py) run through the real harness on the tiny model;
the audit must fail each with the right finding at the right place."""
import pytest

from audit_helpers import find_leg, findings, first_mismatch, prompt_ids, read_records, run_audit, run_harness


def diverging_run(tmp_path, decoder):
    stream = run_harness(tmp_path / "run", decoder, limit=1, n=12, legs=1)
    records = read_records(stream)
    pid = prompt_ids(records)[0]
    ctl = find_leg(records, pid, "control", 0)["tokens"]
    cand = find_leg(records, pid, "candidate", 0)["tokens"]
    return stream, pid, ctl, cand


@pytest.mark.parametrize("decoder", ["bad_decoders:Unverified", "bad_decoders:SkipLayers"])
def test_inexact_decoder_fails_at_its_first_wrong_token(tmp_path, decoder):
    stream, pid, ctl, cand = diverging_run(tmp_path, decoder)
    pos = first_mismatch(cand, ctl)
    assert pos is not None, "the bad decoder happened to be exact here; the test needs a divergence"
    result, doc = run_audit(stream)
    assert result.exit_code == 1, result.output
    (f,) = findings(doc, "exactness")
    assert (f["prompt_id"], f["leg"], f["position"]) == (pid, "candidate#0", pos)
    assert (f["emitted"], f["greedy"]) == (cand[pos], ctl[pos])
    assert doc["prompts"][0]["first_divergence"]["position"] == pos
    assert not doc["exact"] and doc["score"] == 0.0 and doc["verdict"] == "fail"


def test_prompt_cache_is_a_warm_leg_finding(tmp_path):
    """Real CPU times, with a margin no machine's speed or load can close: leg 0 runs 16 serial
    forwards of the model (milliseconds), legs 1-2 are a dict lookup (microseconds), so the
    candidate's later/first is below 0.01 on any CPU, 60x under the 0.6 asserted. The flag also
    needs the control's own later/first above 0.8, or the candidate's under 0.1x the control's:
    with the candidate near 0.001, the control's identical legs would have to differ 100-fold."""
    stream = run_harness(tmp_path / "run", "bad_decoders:PromptCache", limit=1, n=16, legs=3)
    pid = prompt_ids(read_records(stream))[0]
    result, doc = run_audit(stream)
    assert result.exit_code == 1, result.output
    assert doc["exact"]  # its tokens are right; its times are not
    (f,) = findings(doc, "warm-leg", pid, severity="fail")
    assert f["candidate_later_over_first"] < 0.6
    assert doc["prompts"][0]["warm_leg_flag"] and doc["score"] == 0.0
