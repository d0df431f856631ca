"""Hostile files get clean answers from ``audit replay``: each malformed input exits 2 with one
``error:`` line and writes nothing; checks stay linear in the file; header claims the prompt
records contradict, deleted fingerprints, the harness's violation records and unstable legs are
findings. One clean serial stream on tiny (CPU) is recorded per session and copied per test."""
import json
import math
import os
import time

import pytest

from audit_helpers import copy_stream, edit, findings, read_records, retime, run_audit, run_harness

from audit import checks
from audit.stream import PromptRun


@pytest.fixture(scope="session")
def clean_stream(tmp_path_factory):
    return run_harness(tmp_path_factory.mktemp("hostile") / "run", "serial", limit=2, n=8, legs=2)


@pytest.fixture
def stream(clean_stream, tmp_path):
    return copy_stream(clean_stream, tmp_path / "run")


@pytest.fixture(scope="session")
def six_prompts(tmp_path_factory):
    """Six prompts: the fewest whose median ratio has an interval, which a claimed score needs."""
    return run_harness(tmp_path_factory.mktemp("hostile-six") / "run", "serial", limit=6, n=4, legs=2)


def replace_first(stream, old: str, new: str) -> None:
    text = stream.read_text()
    assert old in text
    stream.write_text(text.replace(old, new, 1))


def assert_bad_input(stream, needle: str, *args, out=None):
    out = out or stream.parent / "audit.json"
    result, _ = run_audit(stream, *args, out=out)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert not (stream.parent / "audit.json").exists() and not (out.exists() and out.is_file())
    return lines[0]


# --------------------------------------------------------------------------- numbers and nesting


def test_overflowing_float_anywhere(stream):
    replace_first(stream, '"wall_s":', '"wall_s":1e999,"was":')
    assert_bad_input(stream, "non-finite number 1e999")


def test_nan_inside_the_header(stream):
    replace_first(stream, '"seed":', '"noise":NaN,"seed":')
    assert_bad_input(stream, "non-finite number NaN")


def test_infinity_in_a_token_list(stream):
    records = read_records(stream)
    leg = next(r for r in records if r["type"] == "leg")
    old = '"tokens":[' + str(leg["tokens"][0])
    replace_first(stream, old, '"tokens":[Infinity')
    assert_bad_input(stream, "non-finite number Infinity")


def test_400_digit_integer(stream):
    replace_first(stream, '"tokens":[', '"tokens":[' + "7" * 400 + ",")
    assert_bad_input(stream, "integer of 400 digits")


def test_nesting_200k_deep_is_no_recursion_error(stream):
    replace_first(stream, '"seed":', '"deep":' + "[" * 200_000 + "]" * 200_000 + ',"seed":')
    assert_bad_input(stream, "nested deeper than 32 levels")


# --------------------------------------------------------------------------- counts out of proportion


def test_header_legs_100000_exits_2_quickly(stream):
    edit(stream, lambda recs: recs[0].update(legs=100_000))
    t0 = time.perf_counter()
    assert_bad_input(stream, "legs=100000")
    assert time.perf_counter() - t0 < 20


def test_header_prompt_count_out_of_proportion(stream):
    edit(stream, lambda recs: recs[0]["prompts"].update(count=10**12))
    assert_bad_input(stream, "out of proportion")


def test_leg_checks_are_linear_in_the_legs_present():
    """A prompt claiming a million legs per side costs what its two legs cost."""
    p = PromptRun("p", 2, [1, 2])
    for order, (role, leg) in enumerate([("control", 0), ("candidate", 0)]):
        p.legs.append({"role": role, "leg": leg, "order": order, "t_start": 1.0 + order, "t_end": 1.5 + order,
                       "wall_s": 0.5, "tokens": [1]})
    t0 = time.perf_counter()
    found = checks.check_leg_set(p, 10**9) + checks.check_leg_order(p, 10**9)
    assert time.perf_counter() - t0 < 1.0
    missing = [f for f in found if f["check"] == "missing-leg"]
    assert [f["legs"] for f in missing] == [list(range(1, 11))] * 2
    assert "and 999999989 more" in missing[0]["message"]
    assert not [f for f in found if f["check"] == "tamper"]


def test_prompt_beyond_the_models_context(stream):
    def grow(recs):
        p = next(r for r in recs if r["type"] == "prompt")
        p["token_ids"] = (p["token_ids"] * 5000)[:5000]

    edit(stream, grow)
    assert_bad_input(stream, "beyond the model's context of 4096")


def test_ten_thousand_copies_of_one_leg_audit_in_linear_time(stream):
    def copies(recs):
        i = next(k for k, r in enumerate(recs) if r["type"] == "leg" and r["role"] == "candidate")
        recs[i + 1:i + 1] = [dict(recs[i]) for _ in range(10_000)]

    edit(stream, copies)
    t0 = time.perf_counter()
    result, doc = run_audit(stream)
    assert time.perf_counter() - t0 < 30
    assert result.exit_code == 1 and any("more than once" in f["message"] for f in findings(doc, "tamper"))


# --------------------------------------------------------------------------- not a stream


def test_random_bytes_are_not_a_stream(stream):
    stream.write_bytes(os.urandom(4096).replace(b"\n", b"\x00"))
    line = assert_bad_input(stream, "not a stream.jsonl")
    assert "truncated" not in line


def test_json_that_is_not_a_stream(stream):
    stream.write_text('{"hello": "world"}\n')
    assert_bad_input(stream, "not a stream.jsonl")


def test_directory_argument_uses_its_stream(stream):
    result, doc = run_audit(stream.parent)
    assert result.exit_code == 0, result.output
    assert doc["verdict"] == "pass" and doc["stream"] == str(stream)


def test_directory_without_a_stream(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_bad_input(tmp_path / "empty", "without a stream.jsonl", out=tmp_path / "audit.json")


def test_out_naming_a_directory_fails_before_the_replay(stream, tmp_path):
    target = tmp_path / "outdir"
    target.mkdir()
    from audit.cli import main as audit_main
    from click.testing import CliRunner

    result = CliRunner().invoke(audit_main, ["replay", str(stream), "--out", str(target)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "is a directory" in result.stderr
    assert "replaying" not in result.stderr and list(target.iterdir()) == []
    assert not (stream.parent / "audit.json").exists()


# --------------------------------------------------------------------------- header claims against the records


def test_header_prompt_sha256_inconsistent(stream):
    edit(stream, lambda recs: recs[0]["prompts"].update(sha256="0" * 64))
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    (f,) = findings(doc, "prompts", None, "fail")
    assert "sha256" in f["message"] and f["header_sha256"] == "0" * 64
    assert not doc["consistent"] and doc["score"] == 0.0


def test_header_prompt_count_inconsistent(stream):
    edit(stream, lambda recs: recs[0]["prompts"].update(count=1))
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    (f,) = findings(doc, "prompts", None, "fail")
    assert (f["header_count"], f["records"]) == (1, 2)


def test_a_stdlib_set_recorded_under_another_python_is_not_rebuilt(tiny):
    """stdlib-* snippets are cut from the running Python's standard library: under another Python
    version the set cannot be rebuilt, so its sha256 is a warning, not a failure; under the same
    version a tampered record is still caught."""
    from audit.pipeline import reference_prompts

    header = {"prompts": {"source": "builtin:stdlib-heldout:2"}, "versions": {"python": "0.0.0"}}
    why = reference_prompts(header, tiny, 2)
    assert isinstance(why, str) and "Python standard library" in why and "0.0.0" in why
    (f,) = checks.check_prompt_set({"prompts": {"count": 0}}, [], why)
    assert f["severity"] == "warn"
    import platform

    header["versions"]["python"] = platform.python_version()
    prompts, info = reference_prompts(header, tiny, 2)
    assert len(prompts) == 2 and info["source"] == "builtin:stdlib-heldout:2"


def test_prompt_token_ids_not_the_named_set(stream):
    def swap(recs):
        p = next(r for r in recs if r["type"] == "prompt")
        p["token_ids"][0] = (p["token_ids"][0] + 1) % 512

    edit(stream, swap)
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    assert any("are not the prompts of" in f["message"] for f in findings(doc, "prompts", None, "fail"))


@pytest.mark.parametrize("key", ["weights_fingerprint", "config_sha256"])
def test_builtin_without_fingerprint_fails(stream, key):
    edit(stream, lambda recs: recs[0]["model"].pop(key))
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    (f,) = findings(doc, "model", None, "fail")
    assert f["mismatched"] == [key] and "missing from the stream" in f["message"]
    assert not doc["exact"] and doc["score"] == 0.0


# --------------------------------------------------------------------------- harness violations and warm-up


def test_violation_record_fails_the_audit(stream):
    def add(recs):
        recs[0]["integrity_checked"] = True
        recs.insert(2, {"type": "violation", "at": "after leg 0 of prompt 'x'",
                        "problem": "torch.get_default_dtype() is torch.float64, pinned torch.float32"})

    edit(stream, add)
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    (f,) = findings(doc, "in-process-integrity", None, "fail")
    assert f["at"] == "after leg 0 of prompt 'x'" and "float64" in f["problem"]
    assert "after leg 0 of prompt 'x'" in f["message"] and "float64" in f["message"]
    assert not doc["consistent"] and doc["score"] == 0.0
    assert "in-process-integrity" in result.stdout


def test_stream_without_integrity_checked_is_audited_as_before(stream):
    edit(stream, lambda recs: recs[0].pop("integrity_checked", None))
    result, doc = run_audit(stream)
    assert result.exit_code == 0, result.output
    assert not findings(doc, "in-process-integrity")


@pytest.mark.parametrize("warm, needle", [("same", "the timed prompt itself"), ("short", "tokens, the prompt")])
def test_warmup_prompt_must_differ_and_match_length(stream, warm, needle):
    def set_warm(recs):
        p = next(r for r in recs if r["type"] == "prompt")
        p["warmup_ids"] = list(p["token_ids"]) if warm == "same" else p["token_ids"][:-1]

    edit(stream, set_warm)
    result, doc = run_audit(stream)
    assert result.exit_code == 1
    (f,) = findings(doc, "warmup-prompt")
    assert needle in f["message"]


# --------------------------------------------------------------------------- noise


def test_unstable_legs_warn_and_mark_the_run_without_changing_the_verdict(six_prompts, tmp_path):
    # the candidate's later legs take twice its first (spread 100%): noise, not a cache
    stream = copy_stream(six_prompts, tmp_path / "run")
    edit(stream, lambda recs: retime(recs, 1.0, {0: 0.5, 1: 1.0}))
    result, doc = run_audit(stream)
    assert result.exit_code == 0, result.output
    assert doc["unstable"] is True and doc["verdict"] == "pass"
    warns = findings(doc, "unstable", severity="warn")
    assert {f["prompt_id"] for f in warns} == {e["id"] for e in doc["prompts"]}
    assert all(f["role"] == "candidate" and f["spread"] == pytest.approx(1.0) for f in warns)
    m = doc["median_ratio"]
    assert m == pytest.approx(2.0)
    assert doc["score"] == pytest.approx(0.95 * (1 - math.exp(-(m - 1) / 2.0)))
    assert "WARNING: 6 of 6 prompts have unstable legs" in result.stdout and "the run is unstable" in result.stdout
    assert json.loads((stream.parent / "audit.json").read_text())["unstable"] is True


# --------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("control", [
    {"name": "serial", "spec": "importlib:import_module", "args": {"name": "slowctl"}},
    {"name": "serial", "spec": "serial", "args": {"sleep": 1}},
])
def test_a_control_named_serial_but_built_otherwise_is_never_scored(six_prompts, tmp_path, control):
    """A header may name its reference "serial" yet build it from a plug-in spec or with arguments
    (the retime would then start that code as the control): not the built-in serial control, so
    the run is audited, with a reference warning, and never scored."""
    stream = copy_stream(six_prompts, tmp_path / "run")
    edit(stream, lambda recs: (retime(recs, 1.0, {0: 0.5, 1: 0.5}), recs[0]["control"].update(control)))
    result, doc = run_audit(stream)
    (f,) = findings(doc, "reference", severity="warn")
    assert "not the built-in serial control" in f["message"] and repr(control["spec"]) in f["message"]
    assert doc["median_ratio"] == pytest.approx(2.0) and doc["score"] == 0.0


def test_is_serial_control():
    from audit.checks import is_serial_control

    assert is_serial_control({"name": "serial"}) and is_serial_control({"name": "serial", "spec": "serial", "args": {}})
    assert not is_serial_control({"name": "fast-serial"})
    assert not is_serial_control({"name": "serial", "spec": "pkg.mod:Serial"})
    assert not is_serial_control({"name": "serial", "args": {"x": 1}})
