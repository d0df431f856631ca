"""``audit replay`` end to end on the tiny model: a clean serial run passes; tampered copies of
it fail with the right finding; bad input exits 2 with one line and writes nothing.

One clean stream is recorded per session and copied for each test. Most edits are resealed
(the end record's count/sha256 recomputed), so each test shows the audit catches the edit itself,
not only the broken seal.
"""
import json
import math
import re
import statistics
import subprocess
import sys

import pytest

from audit_helpers import (copy_stream, edit, find_leg, findings, legs_of, prompt_ids, read_records, run_audit,
                           run_harness, retime, write_records)

TOP_KEYS = {"schema", "stream", "stream_sha256", "verdict", "exact", "replayed", "consistent", "score", "claimed_score",
            "score_params",
            "unstable", "median_ratio", "claimed_interval", "f_mem", "memory", "replay", "model", "header_model",
            "candidate", "instrument",
            "reference", "prompts", "findings"}
PROMPT_KEYS = {"id", "exact", "tokens", "ratio", "harness_ratio", "control_median_s", "candidate_median_s",
               "control_peak_bytes", "candidate_peak_bytes", "first_divergence", "warm_leg_flag", "leg_spread"}


@pytest.fixture(scope="session")
def clean_stream(tmp_path_factory):
    return run_harness(tmp_path_factory.mktemp("clean") / "run", "serial", limit=2, n=12, legs=2)


@pytest.fixture
def stream(clean_stream, tmp_path):
    return copy_stream(clean_stream, tmp_path / "run")


@pytest.fixture(scope="session")
def six_prompts(tmp_path_factory):
    """Six prompts: the fewest whose median ratio has a 95% interval, which a claimed score needs."""
    return run_harness(tmp_path_factory.mktemp("six") / "run", "serial", limit=6, n=4, legs=2)


def fails(doc):
    return [f for f in doc["findings"] if f["severity"] == "fail"]


# --------------------------------------------------------------------------- clean runs


def test_clean_serial_run_passes(stream):
    result, doc = run_audit(stream, "--s-max", "0.9", "--kappa", "3", "--mem-allowance", "1.5")
    assert result.exit_code == 0, result.output
    assert set(doc) == TOP_KEYS
    assert doc["schema"] == "qwen35-exact/audit/1"
    assert (doc["verdict"], doc["exact"], doc["replayed"], doc["consistent"]) == ("pass", True, True, True)
    assert fails(doc) == []
    assert doc["score_params"] == {"s_max": 0.9, "kappa": 3.0, "mem_allowance": 1.5}
    records = read_records(stream)
    for entry in doc["prompts"]:
        assert set(entry) == PROMPT_KEYS
        assert entry["exact"] and entry["first_divergence"] is None and not entry["warm_leg_flag"]
        legs = legs_of(records, entry["id"])
        ctl = statistics.median(r["wall_s"] for r in legs if r["role"] == "control")
        first = next(r["wall_s"] for r in legs if r["role"] == "candidate" and r["leg"] == 0)
        assert entry["ratio"] == pytest.approx(ctl / first, rel=1e-12)  # core.schema.prompt_ratio
    # the replay walked each prompt's serial stream exactly once
    expected = sum(len(find_leg(records, pid, "control", 0)["tokens"]) for pid in prompt_ids(records))
    assert doc["replay"]["tokens_replayed"] == expected
    assert doc["replay"]["path"] == "pristine-serial" and doc["replay"]["ms_per_token"] > 0
    assert doc["model"]["weights_fingerprint"] == doc["header_model"]["weights_fingerprint"]
    assert (doc["memory"], doc["f_mem"]) == ({"control_peak_bytes": None, "candidate_peak_bytes": None,
                                             "ratio": None, "resident_bytes": None}, 1.0)
    assert "verdict: PASS" in result.stdout and "prose" in result.stdout


def test_faster_candidate_is_scored_with_memory(six_prompts, tmp_path):
    """A consistent, faster run with measured memory on six prompts: the score follows the formula."""
    stream = copy_stream(six_prompts, tmp_path / "run")
    edit(stream, lambda recs: retime(recs, 1.0, 0.4, peaks={"control": 1000, "candidate": 1800}))
    result, doc = run_audit(stream)
    assert result.exit_code == 0, result.output
    m = doc["median_ratio"]
    assert m == pytest.approx(2.5, rel=1e-9)
    assert doc["memory"] == {"control_peak_bytes": 1000, "candidate_peak_bytes": 1800, "ratio": pytest.approx(1.8),
                             "resident_bytes": None}
    assert doc["f_mem"] == pytest.approx(1.2 / 1.8)
    assert doc["claimed_interval"]["significant"] and doc["claimed_interval"]["low"] == pytest.approx(2.5)
    assert doc["score"] == pytest.approx(0.95 * (1 - math.exp(-(m - 1) / 2.0)) * 1.2 / 1.8)


def test_a_speed_up_the_prompts_cannot_tell_from_none_is_not_scored(six_prompts, stream, tmp_path):
    """The claimed score follows the retime's rule: a median above 1 whose interval over the
    stream's prompts reaches 1 or below scores nothing, and so does a stream of fewer than 6
    prompts, however fast."""
    six = copy_stream(six_prompts, tmp_path / "six")
    ids = prompt_ids(read_records(six))
    # the candidate twice as fast on four prompts, slower on two: median 2, interval [0.8, 2]
    times = {pid: (0.5 if i < 4 else 1.25) for i, pid in enumerate(ids)}

    edit(six, lambda recs: retime(recs, 1.0, lambda leg: times[leg["prompt_id"]]))
    result, doc = run_audit(six)
    assert doc["median_ratio"] > 1 and doc["claimed_interval"]["low"] <= 1 and not doc["claimed_interval"]["significant"]
    assert doc["score"] == 0 and "not above 1: no score" in result.stdout

    edit(stream, lambda recs: retime(recs, 1.0, 0.1))  # ten times as fast, on two prompts
    result, doc = run_audit(stream)
    assert doc["median_ratio"] == pytest.approx(10.0) and doc["score"] == 0 and result.exit_code == 0
    assert doc["claimed_interval"]["low"] is None and "needs 6: no score" in result.stdout


def test_peaks_exclude_the_other_decoders_resident_bytes(stream):
    """Header memory.resident_bytes: a leg's own peak is its raw peak less the other side's buffers."""
    def mark(recs):
        retime(recs, 1.0, 0.5, peaks={"control": 1500, "candidate": 1900})
        recs[0]["memory"] = {"resident_bytes": {"control": 100, "candidate": 500}}

    edit(stream, mark)
    result, doc = run_audit(stream)
    assert result.exit_code == 0, result.output
    assert (doc["memory"]["control_peak_bytes"], doc["memory"]["candidate_peak_bytes"]) == (1000, 1800)
    assert doc["f_mem"] == pytest.approx(1.2 / 1.8)
    assert doc["prompts"][0]["candidate_peak_bytes"] == 1800

    def inflate(recs):  # a resident figure no raw peak could hold: edited
        recs[0]["memory"]["resident_bytes"]["candidate"] = 5000

    edit(stream, inflate)
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    assert any("resident" in f["message"] for f in findings(doc, "tamper", None))


def test_instrument_is_audited_but_never_scored(stream):
    def mark(recs):
        retime(recs, 1.0, 0.5)
        recs[0]["candidate"]["instrument"] = True

    edit(stream, mark)
    result, doc = run_audit(stream)
    assert result.exit_code == 0, result.output
    assert doc["exact"] and doc["instrument"] and doc["score"] == 0.0
    assert doc["median_ratio"] == pytest.approx(2.0, rel=1e-9)
    assert [f["severity"] for f in findings(doc, "instrument")] == ["warn"]


# --------------------------------------------------------------------------- tampered token streams


def test_flipped_candidate_token_is_an_exactness_finding(stream):
    records = read_records(stream)
    pid = prompt_ids(records)[0]
    leg = find_leg(records, pid, "candidate", 1)
    pos = min(3, len(leg["tokens"]) - 1)
    greedy = leg["tokens"][pos]
    flipped = (greedy + 1) % 512

    def flip(recs):
        find_leg(recs, pid, "candidate", 1)["tokens"][pos] = flipped

    edit(stream, flip)
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    (f,) = findings(doc, "exactness")
    assert (f["prompt_id"], f["leg"], f["position"], f["emitted"], f["greedy"]) == (pid, "candidate#1", pos,
                                                                                   flipped, greedy)
    assert len(f["top5"]) == 5 and f["top5"][0][0] == greedy and f["margin"] >= 0
    entry = next(e for e in doc["prompts"] if e["id"] == pid)
    assert not entry["exact"] and entry["first_divergence"]["position"] == pos
    assert doc["score"] == 0.0 and not doc["exact"]
    assert f"candidate#1 @{pos}" in result.stdout  # the first-divergence report in the table


def test_unsealed_edit_is_an_integrity_finding(stream):
    def flip(recs):
        leg = next(r for r in recs if r["type"] == "leg" and r["role"] == "candidate")
        leg["stats"]["forwards"] += 1  # harmless field: only the seal can tell

    edit(stream, flip, reseal=False)
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    assert [f["message"] for f in findings(doc, "integrity")] == [
        "end record's sha256 does not match the file (the stream was edited after it was written)"]
    assert doc["score"] == 0.0 and not doc["consistent"]


def test_truncated_stream_dropped_lines(stream):
    records = read_records(stream)
    last = prompt_ids(records)[-1]
    write_records(stream, records[:-3], reseal=False)  # end, summary and last leg gone
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    assert "truncated" in findings(doc, "integrity")[0]["message"]
    (missing,) = findings(doc, "missing-leg", last)
    assert (missing["role"], missing["legs"]) == ("control", [1])
    assert any("no summary" in f["message"] for f in findings(doc, "tamper", last))


def test_truncated_leg_tokens_are_a_stop_finding(stream):
    records = read_records(stream)
    pid = prompt_ids(records)[0]
    full = find_leg(records, pid, "candidate", 0)["tokens"]
    cut = len(full) - 3

    def drop(recs):
        leg = find_leg(recs, pid, "candidate", 0)
        leg["tokens"] = leg["tokens"][:cut]

    edit(stream, drop, reseal=False)
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    (f,) = findings(doc, "stop")
    assert (f["prompt_id"], f["leg"], f["position"], f["emitted"], f["greedy"]) == (pid, "candidate#0", cut,
                                                                                   None, full[cut])
    assert findings(doc, "integrity")


def test_control_leg_that_disagrees(stream):
    records = read_records(stream)
    pid = prompt_ids(records)[0]

    def change(recs):
        toks = find_leg(recs, pid, "control", 1)["tokens"]
        toks[2] = (toks[2] + 7) % 512

    edit(stream, change)
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    (f,) = findings(doc, "control-consistency")
    assert (f["prompt_id"], f["position"], f["legs"]) == (pid, 2, ["control#0", "control#1"])
    assert [(g["leg"], g["position"]) for g in findings(doc, "exactness", pid)] == [("control#1", 2)]
    assert not doc["consistent"]


# --------------------------------------------------------------------------- tampered times and summaries


def test_swapped_leg_times(stream):
    records = read_records(stream)
    pid = prompt_ids(records)[0]

    def swap(recs):
        a, b = find_leg(recs, pid, "control", 0), find_leg(recs, pid, "candidate", 0)
        for key in ("wall_s", "t_start", "t_end"):
            a[key], b[key] = b[key], a[key]

    edit(stream, swap)
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    moved = [f for f in findings(doc, "tamper", pid) if f.get("legs") == ["control#0", "candidate#0"]]
    assert moved and "moved" in moved[0]["message"]
    assert doc["score"] == 0.0


def test_edited_leg_time(stream):
    records = read_records(stream)
    pid = prompt_ids(records)[1]

    def halve(recs):
        find_leg(recs, pid, "candidate", 1)["wall_s"] *= 0.5

    edit(stream, halve)
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    assert any(f.get("leg") == "candidate#1" and "wall_s" in f["message"] for f in findings(doc, "tamper", pid))


def test_consistently_edited_leg_time_disagrees_with_summary(stream):
    """Shorten a candidate leg everywhere in the leg record: the summary gives it away."""
    records = read_records(stream)
    pid = prompt_ids(records)[0]

    def shorten(recs):
        leg = find_leg(recs, pid, "candidate", 1)
        leg["t_end"] = leg["t_start"] + leg["wall_s"] * 0.25
        leg["wall_s"] = leg["t_end"] - leg["t_start"]

    edit(stream, shorten)
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    assert "candidate_median_s" in {f.get("field") for f in findings(doc, "tamper", pid)}


def test_edited_summary(stream):
    records = read_records(stream)
    pid = prompt_ids(records)[1]

    def inflate(recs):
        next(r for r in recs if r["type"] == "summary" and r["prompt_id"] == pid)["ratio"] *= 1.25

    edit(stream, inflate)
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    (f,) = findings(doc, "tamper", pid)
    assert f["field"] == "ratio" and f["recomputed"] == pytest.approx(f["harness"] / 1.25)
    entry = next(e for e in doc["prompts"] if e["id"] == pid)
    assert entry["harness_ratio"] == pytest.approx(entry["ratio"] * 1.25)


def test_edited_end_median(stream):
    def inflate(recs):
        recs[-1]["median_ratio"] *= 2

    edit(stream, inflate)
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    (f,) = findings(doc, "tamper", None)
    assert f["field"] == "median_ratio"


def test_deleted_leg(stream):
    records = read_records(stream)
    pid = prompt_ids(records)[1]
    victim = find_leg(records, pid, "candidate", 1)
    write_records(stream, [r for r in records if r is not victim])
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    (f,) = findings(doc, "missing-leg")
    assert (f["prompt_id"], f["role"], f["legs"]) == (pid, "candidate", [1])
    assert doc["score"] == 0.0 and doc["verdict"] == "fail"


def test_legs_reordered_in_file(stream):
    records = read_records(stream)
    i = next(k for k, r in enumerate(records) if r["type"] == "leg")
    records[i], records[i + 1] = records[i + 1], records[i]
    write_records(stream, records)
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    assert any("order they ran" in f["message"] for f in findings(doc, "tamper"))


def test_mixed_memory_nulls_are_tamper(stream):
    def peaks(recs):
        for r in recs:
            if r["type"] == "leg" and r["role"] == "control":
                r["peak_mem_bytes"] = 1000

    edit(stream, peaks)
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    assert any("peak_mem_bytes" in f["message"] for f in findings(doc, "tamper", None))


# --------------------------------------------------------------------------- header


def test_recorded_in_another_determinism_configuration(stream):
    def unpin(recs):
        recs[0]["determinism"]["deterministic_algorithms"] = False

    edit(stream, unpin)
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    (f,) = findings(doc, "determinism")
    assert "deterministic_algorithms" in f["message"]


def test_missing_determinism_settings(stream):
    edit(stream, lambda recs: recs[0].update(determinism={}))
    result, doc = run_audit(stream)
    assert result.exit_code == 1 and findings(doc, "determinism")


def test_other_model_identity_is_refused_replay(stream):
    edit(stream, lambda recs: recs[0]["model"].update(weights_fingerprint="0" * 64))
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    (f,) = findings(doc, "model")
    assert f["mismatched"] == ["weights_fingerprint"]
    assert not doc["exact"] and doc["replay"]["tokens_replayed"] == 0


def test_device_mismatch_refused_unless_allowed(stream):
    """Replayed on the CPU that recorded it, a stream that says it was recorded on an H200 (on a
    machine with a GPU, the recording device's type would otherwise replay it there)."""
    edit(stream, lambda recs: recs[0].update(device={"type": "cuda", "name": "NVIDIA H200"}))
    result, doc = run_audit(stream, "--device", "cpu")
    assert result.exit_code == 2 and doc is None
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "NVIDIA H200" in lines[0] and "--allow-device-mismatch" in lines[0]
    result, doc = run_audit(stream, "--device", "cpu", "--allow-device-mismatch")
    assert result.exit_code == 0, result.output
    assert [f["severity"] for f in findings(doc, "device")] == ["warn"]


# --------------------------------------------------------------------------- bad input


def _malformed(path):
    lines = path.read_text().splitlines(keepends=True)
    lines[3] = lines[3][: len(lines[3]) // 2] + "\n"
    path.write_text("".join(lines))


def _schema(path):
    edit(path, lambda recs: recs[0].update(schema="qwen35-exact/stream/99"))


def _duplicate_ids(path):
    def dup(recs):
        ids = [r for r in recs if r["type"] == "prompt"]
        ids[1]["id"] = ids[0]["id"]

    edit(path, dup)


def _non_finite(token):
    def apply(path):  # written into the file as the bare constant json.dumps would emit
        text = path.read_text()
        path.write_text(re.sub(r'"wall_s":[-0-9.eE+]+', '"wall_s":' + token, text, count=1))

    return apply


def _no_file(path):
    path.unlink()


def _unloadable_header_model(path):
    edit(path, lambda recs: recs[0].update(model={"name": "/nonexistent/checkpoint", "kind": "checkpoint"}))


@pytest.mark.parametrize("damage, needle", [
    (_malformed, "not valid JSON"),
    (_schema, "unknown schema"),
    (_duplicate_ids, "duplicate prompt id"),
    (_non_finite("NaN"), "non-finite"),
    (_non_finite("Infinity"), "non-finite"),
    (_non_finite("-Infinity"), "non-finite"),
    (_no_file, "no such file"),
    (_unloadable_header_model, "cannot load model"),
], ids=["malformed-line", "unknown-schema", "duplicate-prompt-ids", "nan-time", "inf-time", "neg-inf-time",
        "nonexistent-file", "unloadable-header-model"])
def test_bad_input_exits_2_with_one_line(stream, damage, needle):
    damage(stream)
    result, doc = run_audit(stream)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], result.stderr
    assert doc is None and not (stream.parent / "audit.json").exists()
    assert "Traceback" not in result.output


def test_unloadable_model_option_exits_2(stream):
    result, doc = run_audit(stream, "--model", "/nonexistent/model")
    assert result.exit_code == 2 and doc is None
    assert len(result.stderr.strip().splitlines()) == 1 and "cannot load model" in result.stderr


def test_full_run_imports_nothing_forbidden(stream, tmp_path):
    """The import rule holds for a whole audit, lazy imports included."""
    out = tmp_path / "audit.json"
    code = (
        "import sys\n"
        "from audit.cli import main\n"
        "try:\n"
        f"    main(['replay', {str(stream)!r}, '--out', {str(out)!r}])\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "bad = sorted(m for m in sys.modules if m == 'decoders' or m.startswith('decoders.')\n"
        "             or m == 'harness' or m.startswith('harness.'))\n"
        "print('EXIT', code, 'FORBIDDEN', bad)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "EXIT 0 FORBIDDEN []" in proc.stdout, proc.stdout + proc.stderr
    assert json.loads(out.read_text())["verdict"] == "pass"
