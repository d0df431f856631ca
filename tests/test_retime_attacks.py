"""Each class of attack on ``audit retime``'s verified figure, built on tiny (CPU), more than one
construction per class; each ends in a failing finding, exit 2, UNVERIFIED or a verified score of
0 (docs/audit.md, the threat model):

  prompts that can be enumerated    a custom prompt file of a small space, decoded in advance
  a forged claim, re-sealed         a serial-speed decoder's stream edited to claim 1.2x, 1.5x, 2x
  header facts taken on trust       the instrument mark removed, or the name changed, re-sealed
  a broken seal, a malformed file   refused exactly as audit replay refuses them

Every retime starts two worker processes; tests/ goes on their PYTHONPATH for the plug-ins.
"""
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from audit import sandbox

from audit_helpers import claim_refused, copy_stream, edit, findings, legs_of, read_records, retime, run_audit, run_harness, \
    shorten_candidate, write_records

TESTS = Path(__file__).resolve().parent
N, PROMPTS, LEGS = 24, 3, 2
FRESH = 6  # fresh prompts per retime: the fewest whose median has a 95% interval


@pytest.fixture(autouse=True)
def workers_import_tests(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))


def run_retime(stream: Path, *args: str):
    """Returns (click Result, retime.json document or None)."""
    from audit.cli import main as audit_main

    out = stream.parent / "retime.json"
    result = CliRunner().invoke(audit_main, ["retime", str(stream), "--device", "cpu", "--prompts", str(FRESH), *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result, json.loads(out.read_text()) if out.exists() else None


def assert_fails(result, doc, check: str):
    assert result.exit_code == 1, result.output
    assert doc["verdict"] == "fail" and findings(doc, check, severity="fail"), result.output
    assert doc["verified"] is None or doc["verified"]["score"] == 0


def assert_claim_refused(result, doc):
    """Never a pass for a claim the retime's interval cannot hold (audit_helpers.claim_refused)."""
    assert result.exit_code == 1 and claim_refused(doc), result.output
    assert doc["verified"] is None or doc["verified"]["score"] == 0


# --------------------------------------------------------------------------- enumerable prompts


def write_prompts(path: Path, entries: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


@pytest.mark.parametrize("kind", ["ids", "text"])
def test_a_prompt_space_decoded_in_prepare_gains_nothing(tmp_path, kind):
    """The stream's prompts come from a custom file whose prompts span a small space (2 ids over 5
    positions; 4 tokens of text over 3); the plug-in decodes the whole space in its untimed
    ``prepare()`` and answers from a table. Fresh prompts come from a space of the same kind that
    no table holds (random ids over the vocabulary; runs of stdlib lines), so its claim fails."""
    entries = ([{"id": f"p{i}", "token_ids": ids} for i, ids in
                enumerate([[5, 6, 5, 6, 5], [6, 6, 5, 5, 6], [5, 5, 5, 6, 6]])] if kind == "ids" else
               [{"id": f"p{i}", "text": text} for i, text in enumerate(["a b a", "b a b", "a a b"])])
    prompts = write_prompts(tmp_path / "prompts.jsonl", entries)
    stream = run_harness(tmp_path / "space", "retime_decoders:PrecomputedSpace", limit=PROMPTS, n=N, legs=LEGS,
                         extra=("--prompts", str(prompts), "--decoder-arg", f"prompts={prompts}",
                                "--decoder-arg", "answer_s=0.01"))  # steady answers: no warm-leg flag
    result, doc = run_audit(stream)
    assert doc["exact"] and doc["median_ratio"] > 1.5, result.output  # the in-process claim looks good

    result, doc = run_retime(stream, "--trust-plugin")
    assert_claim_refused(result, doc)
    assert doc["fresh_source"]["kind"] == ("random-ids" if kind == "ids" else "line-runs")
    space = {t for e in read_records(stream) if e["type"] == "prompt" for t in e["token_ids"]}
    assert not any(set(e["token_ids"]) <= space for e in doc["prompts"])  # none from the decodable space
    assert doc["verified"]["ratio"] < doc["claimed"]["ratio"]


def test_with_no_fresh_prompts_that_fit_the_verdict_is_unverified(tmp_path, fast_serial_stream):
    """An auditor's --fresh file whose prompts are all shorter than the stream's: nothing fits, so
    nothing is verified (exit 1, UNVERIFIED), never a pass; a --fresh that is no regular file is
    bad input."""
    short = write_prompts(tmp_path / "short.jsonl", [{"id": "s", "token_ids": [1, 2]}])
    copy = copy_stream(fast_serial_stream, tmp_path / "copy")
    result, doc = run_retime(copy, "--fresh", str(short))
    assert result.exit_code == 1 and doc["verdict"] == "unverified" and doc["verified"] is None, result.output
    assert "too few unused prompts" in doc["unverified_reason"] and "UNVERIFIED" in result.stdout
    (copy.parent / "retime.json").unlink()
    result, doc = run_retime(copy, "--fresh", str(tmp_path))
    assert result.exit_code == 2 and "not a regular file" in result.stderr and doc is None


@pytest.fixture(scope="module")
def fast_serial_stream(tmp_path_factory):
    return run_harness(tmp_path_factory.mktemp("attacks") / "fast", "fast-serial", limit=PROMPTS, n=N, legs=LEGS)


def test_the_auditors_own_fresh_prompts_are_used(tmp_path, fast_serial_stream):
    """--fresh FILE: the auditor's prompts, in file order, each cut to the mirrored prompt's length."""
    from audit.retime.fresh import fresh_prompts
    from audit.stream import load_run
    from core.models import load_model

    run, model = load_run(fast_serial_stream), load_model("tiny", "cpu")
    longest = max(len(p.token_ids) for p in run.prompts)
    own = [[(7 * i + j) % 500 + 1 for j in range(longest + 3)] for i in range(4 * PROMPTS)]
    path = write_prompts(tmp_path / "mine.jsonl", [{"id": f"m{i}", "token_ids": ids} for i, ids in enumerate(own)])
    draw = fresh_prompts(run, model, PROMPTS, 3, path)
    assert draw.source["kind"] == "file" and draw.source["file"] == str(path)
    lengths = {p.id: len(p.token_ids) for p in run.prompts}
    assert [fp.token_ids for fp in draw.first] == [own[i][:lengths[fp.mirrors]] for i, fp in enumerate(draw.first)]
    assert len(draw.second) == PROMPTS and all(fp.spare is not None for fp in draw.first + draw.second)


@pytest.mark.skipif(sandbox.plan("/tmp").tool is None,
                    reason="hiding a file needs a sandbox (bubblewrap, or unshare as root)")
def test_the_auditors_fresh_file_is_hidden_from_the_candidate(tmp_path):
    """A plug-in that reads the auditor's --fresh file in ``prepare()`` and decodes its prompts in
    advance would answer every fresh prompt from its table; the candidate's sandbox hides the file
    (given here through a symlink, hidden at its real path), so it reads nothing there and its
    claim fails."""
    from audit.retime.fresh import fresh_prompts
    from audit.stream import load_run
    from core.models import load_model
    from core.prompts import load_prompts
    from retime_decoders import PeeksAtTheFreshFile

    model = load_model("tiny", "cpu")
    longest = max(len(p.token_ids) for p in load_prompts(None, model, limit=PROMPTS)[0])
    (tmp_path / "auditor").mkdir()
    own = write_prompts(tmp_path / "auditor" / "mine.jsonl",
                        [{"id": f"m{i}", "token_ids": [(7 * i + j) % 500 + 1 for j in range(longest + 3)]}
                         for i in range(FRESH)])
    link = tmp_path / "link.jsonl"
    link.symlink_to(own)
    stream = run_harness(tmp_path / "peek", "retime_decoders:PeeksAtTheFreshFile", limit=PROMPTS, n=N, legs=LEGS,
                         extra=("--decoder-arg", f"fresh={link}", "--decoder-arg", f"limit={PROMPTS}"))
    # where it can read the file, every fresh prompt of a retime is in its table
    peeker = PeeksAtTheFreshFile(str(link), PROMPTS)
    peeker.prepare(model)
    draw = fresh_prompts(load_run(stream), model, FRESH, 1, link)
    assert all(tuple(fp.token_ids) in peeker.table for fp in draw.first)

    result, doc = run_retime(stream, "--trust-plugin", "--fresh", str(link))
    assert doc["sandbox"]["hidden"] == [str(own.resolve())], result.output
    assert doc["fresh_source"]["kind"] == "file"
    assert_claim_refused(result, doc)
    assert all(e["exact"] for e in doc["prompts"]) and doc["verified"]["ratio"] < 2 < doc["claimed"]["ratio"]


# --------------------------------------------------------------------------- forged claims


@pytest.fixture(scope="module")
def serial_speed_stream(tmp_path_factory):
    """An honest stream of a decoder no faster than the control."""
    return run_harness(tmp_path_factory.mktemp("slow") / "slow", "retime_decoders:SerialSpeed", limit=PROMPTS,
                       n=N, legs=LEGS)


def fixed_legs(claim: float):
    def forge(records):
        retime(records, 0.2, 0.2 / claim)  # every leg a fixed time, laid out back to back
    return forge


def shortened(claim: float):
    def forge(records):
        prompts = [r["id"] for r in records if r["type"] == "prompt"]
        now = sorted((lambda legs: sum(x["wall_s"] for x in legs if x["role"] == "control") /
                      (2 * next(x["wall_s"] for x in legs if x["role"] == "candidate" and x["leg"] == 0)))(
            legs_of(records, pid)) for pid in prompts)[len(prompts) // 2]
        shorten_candidate(records, now / claim)  # the candidate's legs cut to the claimed ratio
    return forge


def noisy_control(claim: float):
    """Control legs 100% apart (a spread the old rule let a stream widen its allowance with)."""
    def forge(records):
        retime(records, 0.2, 0.3 / claim)  # the control's median leg: 0.3 s
        for r in records:
            if r["type"] == "leg" and r["role"] == "control" and r["leg"] == 1:
                r["t_end"] = r["t_start"] + 0.4
                r["wall_s"] = 0.4
        retime_spread(records)
    return forge


def retime_spread(records):
    """Lay the legs out again after the edit and recompute summaries (``retime`` with the legs' own
    times)."""
    import statistics

    from harness.timing import summarize_prompt

    t = 1.0
    for r in records:
        if r["type"] == "leg":
            wall = r["wall_s"]
            r["t_start"], r["t_end"] = t, t + wall
            t += wall + 0.001
    ratios = []
    for i, r in enumerate(records):
        if r["type"] == "summary":
            records[i] = {**r, **summarize_prompt(r["prompt_id"], legs_of(records, r["prompt_id"]))}
            ratios.append(records[i]["ratio"])
        elif r["type"] == "end":
            r["median_ratio"] = statistics.median(ratios)


@pytest.mark.parametrize("forge, claim", [(fixed_legs, 1.2), (shortened, 1.5), (fixed_legs, 2.0),
                                          (noisy_control, 1.8)])
def test_a_serial_speed_stream_forged_to_claim_more_fails(serial_speed_stream, tmp_path, forge, claim):
    """The stream of a decoder no faster than serial, its legs edited to claim ``claim`` and
    re-sealed: replay's timing checks find it self-consistent, the retime's own legs do not
    reproduce it, and its verified score is 0 whatever it claims."""
    stream = copy_stream(serial_speed_stream, tmp_path / "forged")
    edit(stream, forge(claim))
    result, doc = run_retime(stream, "--trust-plugin")
    assert doc["claimed"]["ratio"] == pytest.approx(claim, rel=0.01)
    # whatever the claim and the noise, the retime's own speed scores nothing
    assert doc["verified"]["ratio"] < 1 and not doc["verified"]["significant"] and doc["verified"]["score"] == 0
    if claim >= 1.5:  # 1.2x lies within the margin honest runs need above the interval: only the score holds it
        assert_claim_refused(result, doc)
    for f in findings(doc, "claim-not-reproduced"):
        assert f["claimed"] > f["ci_high"] * (1 + f["margin"])


# --------------------------------------------------------------------------- header facts


@pytest.fixture(scope="module")
def instrument_stream(tmp_path_factory):
    return run_harness(tmp_path_factory.mktemp("inst") / "inst", "spec-instrument", limit=2, n=N, legs=LEGS)


def unmark(records):
    records[0]["candidate"]["instrument"] = False


def drop_mark(records):
    del records[0]["candidate"]["instrument"]


def rename(records):
    records[0]["candidate"]["name"] = "spec"
    records[0]["candidate"]["instrument"] = False


def reconfigure(records):
    records[0]["candidate"]["config"] = {k: v for k, v in records[0]["candidate"]["config"].items()
                                         if k not in ("instrument", "alpha")}
    records[0]["candidate"]["instrument"] = False


@pytest.mark.parametrize("change", [unmark, drop_mark, rename, reconfigure])
def test_a_header_the_decoder_contradicts_fails(instrument_stream, tmp_path, change):
    """An instrument's stream with its mark removed (and its name or config changed) and re-sealed:
    audit replay would score it; the retime's worker asks the decoder itself, and the header that
    disagrees fails (``header-disagrees``) before anything is timed."""
    stream = copy_stream(instrument_stream, tmp_path / "edited")
    edit(stream, change)
    result, doc = run_retime(stream)
    assert_fails(result, doc, "header-disagrees")
    facts = {f["fact"] for f in findings(doc, "header-disagrees")}
    assert "instrument" in facts and doc["prompts"] == [] and doc["instrument"] is True
    assert all(f["side"] == "candidate" for f in findings(doc, "header-disagrees"))


# --------------------------------------------------------------------------- seal and format


def unsealed_leg(records):
    leg = next(r for r in records if r["type"] == "leg" and r["role"] == "candidate")
    leg["wall_s"] *= 0.5


def cut_end(records):
    records.pop()


def unsealed_header(records):
    records[0]["created"] = "2000-01-01T00:00:00+00:00"


@pytest.mark.parametrize("change", [unsealed_leg, cut_end, unsealed_header])
def test_a_broken_seal_is_refused_as_by_replay(fast_serial_stream, tmp_path, change):
    """An edit without a new seal (or a cut end record): the same file checks as audit replay's
    fail the retime (``integrity``), and nothing is timed."""
    stream = copy_stream(fast_serial_stream, tmp_path / "broken")
    records = read_records(stream)
    change(records)
    write_records(stream, records, reseal=False)
    result, doc = run_retime(stream)
    assert_fails(result, doc, "integrity")
    assert doc["verified"] is None and doc["prompts"] == [] and "not retimed" in result.output


def test_a_malformed_stream_is_bad_input(fast_serial_stream, tmp_path):
    stream = copy_stream(fast_serial_stream, tmp_path / "malformed")
    records = read_records(stream)
    leg = next(r for r in records if r["type"] == "leg")
    records.insert(1, {**leg, "prompt_id": "nobody"})  # a leg before any prompt declares it
    write_records(stream, records)
    result, doc = run_retime(stream)
    assert result.exit_code == 2 and doc is None and result.stderr.startswith("error:")
