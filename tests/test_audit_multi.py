"""``audit replay A B C``: several streams in one process share the replay walks, and each gets the
audit.json a separate audit of it writes (apart from the replay's seconds). Bad input in any of
them stops everything before a write."""
import json

from click.testing import CliRunner

from audit_helpers import copy_stream, run_audit, run_harness

TIMING = ("seconds", "ms_per_token")


def audit_many(*paths, extra=()):
    from audit.cli import main as audit_main

    return CliRunner().invoke(audit_main, ["replay", *map(str, paths), *extra])


def comparable(doc):
    doc = json.loads(json.dumps(doc))
    for key in TIMING:
        doc["replay"].pop(key)
    return doc


def test_shared_replay_equals_separate_audits(tmp_path):
    # an exact serial run, an exact fast runtime run, and a decoder that diverges (its walk is
    # shorter on its own than the shared one: the per-run counts must not change)
    streams = [run_harness(tmp_path / "serial", "serial", limit=2, n=12, legs=2),
               run_harness(tmp_path / "fast", "fast-serial", limit=2, n=12, legs=1),
               run_harness(tmp_path / "bad", "bad_decoders:Unverified", limit=2, n=12, legs=1)]
    alone = []
    for s in streams:
        result, doc = run_audit(s, out=s.parent / "alone.json")
        assert result.exit_code in (0, 1), result.output
        alone.append(doc)
    assert [d["exact"] for d in alone] == [True, True, False]

    result = audit_many(*streams)
    assert result.exit_code == 1, result.output  # the bad decoder fails the whole command
    assert "2 of 3 streams pass" in result.output
    shared = [json.loads((s.parent / "audit.json").read_text()) for s in streams]
    for a, b in zip(alone, shared):
        assert comparable(a) == comparable(b)
    assert "each distinct prompt once" in result.output


def test_bad_input_in_any_stream_writes_nothing(tmp_path):
    good = run_harness(tmp_path / "good", "serial", limit=1, n=6, legs=1)
    broken = copy_stream(good, tmp_path / "broken")
    broken.write_text(broken.read_text().splitlines()[0] + "\n")  # header only: truncated
    result = audit_many(good, broken)
    assert result.exit_code == 2
    assert str(broken) in result.output and "Traceback" not in result.output
    assert not (good.parent / "audit.json").exists() and not (broken.parent / "audit.json").exists()

    assert audit_many(good, tmp_path / "missing.jsonl").exit_code == 2
    assert not (good.parent / "audit.json").exists()


def test_several_streams_refuse_out_and_repeats(tmp_path):
    a = run_harness(tmp_path / "a", "serial", limit=1, n=4, legs=1)
    b = copy_stream(a, tmp_path / "b")
    result = audit_many(a, b, extra=("--out", str(tmp_path / "x.json")))
    assert result.exit_code == 2 and "--out names one file" in result.output
    result = audit_many(a, a)
    assert result.exit_code == 2 and "named twice" in result.output
    assert not (a.parent / "audit.json").exists()
