"""`reports render`: the report and figures from a real tiny run and from a hand-made richer run.

One small real stream is generated per session (tiny model, 3 prompts, N=16, 2 legs) with the
harness CLI; every test renders a private copy of it. The synthetic run (``write_synthetic_run``)
carries what the tiny run cannot: depth_trace and time_split stats, CUDA peak memory, a failing
audit with a divergence, and long prompt ids; it exercises every figure type.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from core.errors import UserError
from core.schema import SCHEMA, AtomicJsonlWriter, abba_roles, write_json_atomic
from harness.timing import summarize_prompt
from reports import figures as figures_mod
from reports.cli import main as reports_main
from reports.figures import FIGURES
from reports.load import run_from_records
from reports.markdown import write_report
from reports.render import render_run
from reports.summary import summarize_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="session")
def tiny_harness_run(tmp_path_factory):
    """The session's one real run, through `harness time --report` (so the flag is exercised too)."""
    from harness.cli import main as harness_main

    out = tmp_path_factory.mktemp("tiny-run")
    # spec-naive: a fixed depth of 3, so every round drafts and the acceptance figure has data
    res = CliRunner().invoke(harness_main, ["time", "--model", "tiny", "--decoder", "spec-naive", "--device", "cpu",
                                            "--limit", "3", "-n", "16", "--legs", "2", "--warmup-tokens", "0",
                                            "--out", str(out), "--report"])
    assert res.exit_code == 0, res.output
    return out, res.output


@pytest.fixture(scope="session")
def tiny_run_dir(tiny_harness_run) -> Path:
    return tiny_harness_run[0]


@pytest.fixture
def tiny_run(tiny_run_dir, tmp_path) -> Path:
    """A private copy of the session's tiny run, so renders and edits do not leak between tests."""
    dest = tmp_path / "run"
    dest.mkdir()
    shutil.copy2(tiny_run_dir / "stream.jsonl", dest / "stream.jsonl")
    return dest


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "stream.jsonl").read_text().splitlines()]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def render_cli(run_dir: Path):
    return CliRunner().invoke(reports_main, ["render", str(run_dir)])


def table_rows(report: str, section: str) -> list[list[str]]:
    """The cells of the first table under ``## section`` (header and separator dropped)."""
    body = report.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in body.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", ln)[1:-1]] for ln in lines[2:]]


def summary_rows(report: str) -> dict[str, str]:
    return {row[0]: row[1] for row in table_rows(report, "Summary")}


def first_number(text: str) -> float:
    return float(re.search(r"-?\d+(?:\.\d+)?", text).group())


def raw_ratios(records: list[dict]) -> dict[str, float]:
    """Independent recomputation: per prompt, the control's median wall_s over the candidate's leg 0."""
    control, first = {}, {}
    for rec in records:
        if rec["type"] == "leg" and rec["role"] == "control":
            control.setdefault(rec["prompt_id"], []).append(rec["wall_s"])
        elif rec["type"] == "leg" and rec["role"] == "candidate" and rec["leg"] == 0:
            first[rec["prompt_id"]] = rec["wall_s"]
    return {pid: statistics.median(walls) / first[pid] for pid, walls in control.items()}


def raw_medians(records: list[dict]) -> dict[str, dict[str, float]]:
    """Independent recomputation: per prompt, median wall_s per role."""
    out = {}
    for rec in records:
        if rec["type"] == "leg":
            out.setdefault(rec["prompt_id"], {}).setdefault(rec["role"], []).append(rec["wall_s"])
    return {pid: {role: statistics.median(v) for role, v in roles.items()} for pid, roles in out.items()}


def assert_figures(summary: dict, run_dir: Path, expected: set[str]) -> None:
    report = (run_dir / "report.md").read_text()
    assert set(summary["figures"]) == expected
    for stem in FIGURES:
        png = run_dir / "figures" / f"{stem}.png"
        if stem in expected:
            assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000, stem
            assert f"](figures/{stem}.png)" in report
        else:
            assert not png.exists() and f"figures/{stem}.png" not in report
    for ref in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report):
        assert (run_dir / ref).is_file(), ref


def make_audit(run_dir: Path, *, verdict="pass", exact=True, score=0.42, sha=None, prompts=None,
               findings=None, median_ratio=None) -> dict:
    """An audit.json of the shape `audit replay` writes, for the stream in run_dir."""
    records = read_records(run_dir)
    meds = raw_medians(records)
    header = records[0]
    if prompts is None:
        prompts = [{"id": pid, "exact": True, "tokens": 16, "ratio": m["control"] / m["candidate"],
                    "harness_ratio": m["control"] / m["candidate"], "control_median_s": m["control"],
                    "candidate_median_s": m["candidate"], "control_peak_bytes": None,
                    "candidate_peak_bytes": None, "first_divergence": None, "warm_leg_flag": False}
                   for pid, m in meds.items()]
    audit = {
        "schema": "qwen35-exact/audit/1", "stream": str(run_dir / "stream.jsonl"),
        "stream_sha256": sha or sha256_of(run_dir / "stream.jsonl"),
        "verdict": verdict, "exact": exact, "consistent": True, "score": score,
        "score_params": {"s_max": 3.0, "kappa": 4.0, "mem_allowance": 1.1},
        "median_ratio": median_ratio if median_ratio is not None
        else statistics.median(p["ratio"] for p in prompts), "f_mem": 1.0,
        "memory": {"control_peak_bytes": None, "candidate_peak_bytes": None, "ratio": None},
        "replay": {"path": "pristine-serial", "device": "cpu", "tokens_replayed": 48, "seconds": 1.5,
                   "ms_per_token": 31.25},
        "model": header["model"], "header_model": header["model"], "candidate": header["candidate"]["name"],
        "instrument": False, "prompts": prompts, "findings": findings or [],
    }
    write_json_atomic(run_dir / "audit.json", audit)
    return audit


# --------------------------------------------------------------------------- the synthetic rich run

LONG_IDS = ["prose-river", "code-python-merge-two-sorted-lists-with-a-rather-long-identifier",
            "dialogue-support-ticket-escalation-where-the-customer-writes-again", "math-sum-of-squares",
            "list-groceries-for-the-week"]


def synthetic_leg(rng: random.Random, role: str, n: int, tokens: list[int], max_depth: int) -> dict:
    """One leg's timing and stats: a control decodes one token per forward; the candidate drafts
    a varying depth per round, accepts a prefix, and records depth_trace and time_split."""
    if role == "control":
        wall = n * 0.021 * rng.uniform(0.97, 1.05)
        return {"wall_s": wall, "peak_mem_bytes": int(18.25 * 2 ** 30) + rng.randrange(2 ** 24),
                "stats": {"forwards": n, "drafted": 0, "accepted": 0, "drafted_by_depth": [],
                          "accepted_by_depth": [], "accept_hist": {}, "mean_accepted_length": None}}
    depth_trace, hist, drafted_d, accepted_d = [], {}, [0] * max_depth, [0] * max_depth
    emitted, depth = 1, 3
    while emitted < n:
        depth = max(1, min(max_depth, depth + rng.choice((-1, 0, 0, 1))))
        acc = 0
        while acc < depth and rng.random() < 0.78 - 0.06 * acc:
            acc += 1
        depth_trace.append(depth)
        hist[acc] = hist.get(acc, 0) + 1
        for d in range(depth):
            drafted_d[d] += 1
            accepted_d[d] += d < acc
        emitted += acc + 1
    rounds = len(depth_trace)
    wall = rounds * 0.024 * rng.uniform(0.97, 1.05)
    split = {"step": wall * 0.07, "draft": wall * 0.27, "verify": wall * 0.49, "rollback": wall * 0.09}
    split["other"] = wall - sum(split.values())
    accepted = sum(k * v for k, v in hist.items())
    return {"wall_s": wall, "peak_mem_bytes": int(18.9 * 2 ** 30) + rng.randrange(2 ** 24),
            "stats": {"forwards": rounds + 1, "drafted": sum(drafted_d), "accepted": accepted,
                      "drafted_by_depth": drafted_d, "accepted_by_depth": accepted_d,
                      "accept_hist": {str(k): v for k, v in sorted(hist.items())},
                      "mean_accepted_length": (accepted + rounds) / rounds,
                      "depth_trace": depth_trace, "time_split": split}}


def write_synthetic_run(run_dir: Path, *, audit: bool = True, seed: int = 7) -> Path:
    """A hand-made CUDA run with every recordable extra, plus a failing audit of it."""
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    n, legs, max_depth = 96, 3, 6
    header = {
        "type": "header", "schema": SCHEMA, "created": "2026-11-30T09:00:00+00:00",
        "command": ["harness", "time", "--decoder", "spec-adaptive", "--model", "/ckpt/Qwen3.5-9B"],
        "model": {"name": "Qwen3.5-9B", "kind": "checkpoint", "layout": "text-only",
                  "config_sha256": "c" * 64, "weights_fingerprint": "f" * 64},
        "dtype": "bfloat16", "device": {"type": "cuda", "name": "NVIDIA H200"},
        "versions": {"python": "3.11.7", "torch": "2.13.0", "transformers": "5.17.0", "cuda": "12.8"},
        "determinism": {}, "control": {"name": "serial", "config": {"cache": "DynamicCache"}},
        "candidate": {"name": "spec-adaptive", "spec": "spec-adaptive",
                      "config": {"max_depth": max_depth, "policy": "acceptance-driven"}, "instrument": False},
        "prompts": {"count": len(LONG_IDS), "sha256": "a" * 64, "source": "synthetic.jsonl"},
        "max_new_tokens": n, "legs": legs, "warmup_tokens": 8, "seed": 0,
    }
    ratios = []
    with AtomicJsonlWriter(run_dir / "stream.jsonl") as w:
        w.write(header)
        clock = 0.0
        for pid in LONG_IDS:
            w.write({"type": "prompt", "id": pid, "token_ids": [rng.randrange(1000) for _ in range(40)],
                     "text": None})
            tokens = [rng.randrange(1000) for _ in range(n)]
            recs, seen = [], {"control": 0, "candidate": 0}
            for order, role in enumerate(abba_roles(legs)):
                leg = synthetic_leg(rng, role, n, tokens, max_depth)
                rec = {"type": "leg", "prompt_id": pid, "role": role, "leg": seen[role], "order": order,
                       "t_start": clock, "t_end": clock + leg["wall_s"], "tokens": tokens, **leg}
                clock += leg["wall_s"] + 0.001
                seen[role] += 1
                recs.append(rec)
                w.write(rec)
            summary = summarize_prompt(pid, recs)
            summary["same_tokens_as_control"] = True
            ratios.append(summary["ratio"])
            w.write(summary)
        w.write_end(median_ratio=statistics.median(ratios))
        w.commit()
    if audit:
        records = read_records(run_dir)
        meds = raw_medians(records)
        prompts = []
        for i, pid in enumerate(LONG_IDS):
            m = meds[pid]
            div = None
            if i == 2:  # one prompt diverges: the candidate emitted a near-tie runner-up
                div = {"leg": "candidate#0", "position": 41, "emitted": 517, "greedy": 88,
                       "top5": [[88, 21.375], [517, 21.3125], [4, 19.5], [902, 18.25], [13, 17.0]],
                       "margin": 0.0625, "reason": "verify window logits differ from serial in the last bf16 bit"}
            peaks = [r["peak_mem_bytes"] for r in records if r["type"] == "leg" and r["prompt_id"] == pid]
            prompts.append({"id": pid, "exact": div is None, "tokens": n, "ratio": m["control"] / m["candidate"],
                            "harness_ratio": m["control"] / m["candidate"], "control_median_s": m["control"],
                            "candidate_median_s": m["candidate"], "control_peak_bytes": max(peaks[0::2]),
                            "candidate_peak_bytes": max(peaks[1::2]), "first_divergence": div,
                            "warm_leg_flag": i == 4})
        make_audit(run_dir, verdict="fail", exact=False, score=0.0, prompts=prompts,
                   findings=[{"check": "exactness", "severity": "fail", "prompt_id": LONG_IDS[2],
                              "message": "candidate#0 diverges from serial greedy at token 41 "
                                         "(emitted 517, greedy 88)"},
                             {"check": "warm-leg", "severity": "warn", "prompt_id": LONG_IDS[4],
                              "message": "first candidate leg is 40% slower than the others | warm-up too short?"}])
        audit_obj = json.loads((run_dir / "audit.json").read_text())
        audit_obj["memory"] = {"control_peak_bytes": int(18.3 * 2 ** 30), "candidate_peak_bytes": int(18.95 * 2 ** 30),
                               "ratio": 18.95 / 18.3}
        audit_obj["f_mem"] = 1.0
        audit_obj["replay"]["device"] = "NVIDIA H200"
        write_json_atomic(run_dir / "audit.json", audit_obj)
    return run_dir


# --------------------------------------------------------------------------- the tiny run


def test_tiny_run_report_and_figures(tiny_run):
    summary = render_run(tiny_run)
    report = (tiny_run / "report.md").read_text()
    assert_figures(summary, tiny_run, {"speedup", "ms_per_token", "acceptance"})
    # what CPU and spec-naive do not record is said in words, not drawn
    assert "n/a on CPU" in report and "no numbers are shown" in report
    assert "Not recorded: no leg's stats carry a `depth_trace`" in report and "k = 3" in report
    assert "Not recorded: no leg's stats carry a `time_split`" in report
    assert not list(tiny_run.glob(".report-*"))  # the temporary render directory is gone


def test_tiny_summary_numbers_equal_stream(tiny_run):
    records = read_records(tiny_run)
    header, end = records[0], records[-1]
    meds = raw_medians(records)
    ratios = raw_ratios(records)
    median_ratio = statistics.median(ratios.values())
    summary = render_run(tiny_run)

    # the returned summary is the stream's numbers, recomputed from the raw legs
    assert summary["median_ratio"]["candidate"] == pytest.approx(median_ratio, rel=1e-12)
    assert summary["harness_median_ratio"] == end["median_ratio"]
    assert summary["prompt_count"] == 3 == len(meds)
    assert summary["max_new_tokens"] == header["max_new_tokens"] == 16
    assert summary["legs_per_side"] == header["legs"] == 2
    assert summary["leg_records"] == sum(r["type"] == "leg" for r in records) == 12
    for p in summary["prompts"]:
        assert p["median_s"]["control"] == pytest.approx(meds[p["id"]]["control"], rel=1e-12)
        assert p["ratio"]["candidate"] == pytest.approx(ratios[p["id"]], rel=1e-12)
    assert summary["audit"]["status"] == "not audited"

    # ... and report.md says the same numbers
    report = (tiny_run / "report.md").read_text()
    rows = summary_rows(report)
    assert rows["Model"].startswith(f"`{header['model']['name']}`")
    assert header["device"]["name"] in rows["Device"]
    assert "**serial**" in rows["Decoders"] and f"**{header['candidate']['name']}**" in rows["Decoders"]
    assert first_number(rows["Prompts"]) == 3
    assert first_number(rows["N (max new tokens)"]) == 16
    assert first_number(rows["Legs"]) == 2
    assert first_number(rows["Median ratio"]) == pytest.approx(median_ratio, abs=5e-4)
    harness_own = re.search(r"harness's own: ([\d.]+)×", rows["Median ratio"]).group(1)
    assert float(harness_own) == pytest.approx(end["median_ratio"], abs=5e-4)
    assert rows["Score"] == "— (not audited)" and rows["Exact"] == "unknown (not audited)"
    by_id = {row[0].strip("`"): row for row in table_rows(report, "Speedup per prompt")}
    assert set(by_id) == set(ratios)
    head = table_head(report, "Speedup per prompt")
    assert head[3:7] == ["serial median (s)", f"{header['candidate']['name']} first leg (s)",
                         f"{header['candidate']['name']} median (s)", f"ratio {header['candidate']['name']} (raw legs)"]
    for pid, row in by_id.items():
        first = next(r["wall_s"] for r in records if r["type"] == "leg" and r["prompt_id"] == pid
                     and r["role"] == "candidate" and r["leg"] == 0)
        assert float(row[4]) == pytest.approx(first, abs=5e-5)
        assert first_number(row[6]) == pytest.approx(ratios[pid], abs=5e-4)
        # the numbers shown give the ratio shown: control median / candidate's first leg
        assert float(row[3]) / float(row[4]) == pytest.approx(ratios[pid], rel=2e-3, abs=5e-4)
        assert row[-1] == "not audited"


def test_not_audited_banner_comes_first(tiny_run):
    res = render_cli(tiny_run)
    assert res.exit_code == 0, res.output
    report = (tiny_run / "report.md").read_text()
    lines = report.splitlines()
    assert lines[0].startswith("# Run report:")
    assert "NOT AUDITED" in lines[2]  # right under the title, before the summary
    assert report.index("NOT AUDITED") < report.index("## Summary")
    assert "NOT AUDITED" in res.output  # the CLI says it too (stderr is mixed in by CliRunner)
    assert f"wrote {tiny_run / 'report.md'}" in res.output


def test_audited_run_takes_score_and_verdict_from_audit(tiny_run):
    audit = make_audit(tiny_run, score=0.4321, median_ratio=0.777)
    summary = render_run(tiny_run)
    report = (tiny_run / "report.md").read_text()
    rows = summary_rows(report)
    assert "NOT AUDITED" not in report and not summary["banners"]
    assert summary["audit"]["score"] == audit["score"] and summary["audit"]["verdict"] == "pass"
    assert rows["Score"].startswith("**0.432**") and "PASS" in rows["Score"]
    assert rows["Exact"].startswith("yes")
    assert rows["First divergence"] == "none"
    # the audit's own median sits beside, and does not replace, the one from the raw legs
    assert "audit's: 0.777×" in rows["Median ratio"]
    assert first_number(rows["Median ratio"]) == pytest.approx(summary["median_ratio"]["candidate"], abs=5e-4)
    for row in table_rows(report, "Speedup per prompt"):
        assert row[-1] == "yes"


def make_retime(run_dir: Path, *, verdict="pass", sha=None, verified=None) -> dict:
    """A retime.json of the shape `audit retime` writes (the fields the report reads)."""
    doc = {"schema": "qwen35-exact/retime/2", "kind": "retime", "stream_sha256": sha or sha256_of(run_dir / "stream.jsonl"),
           "verdict": verdict, "claimed": {"ratio": 1.5, "prompts": 3}, "fresh_prompts": "scripted",
           "verified": verified, "unverified_reason": None if verified else "no fresh prompts: none fit",
           "findings": [] if verdict != "fail" else [{"check": "claim-not-reproduced", "severity": "fail",
                                                       "prompt_id": None, "message": "m"}]}
    write_json_atomic(run_dir / "retime.json", doc)
    return doc


def test_claimed_and_verified_figures_side_by_side(tiny_run):
    """With a retime.json of this stream the summary shows the verified ratio, interval and score
    beside the audit's claimed score; without one it says how to get them; another stream's or an
    unverified retime's figures are not shown as this run's."""
    make_audit(tiny_run, score=0.4321)
    render_run(tiny_run)
    rows = summary_rows((tiny_run / "report.md").read_text())
    assert "claimed" in rows["Score"] and rows["Verified (audit retime)"].startswith("— (not retimed")
    make_retime(tiny_run, verified={"ratio": 1.234, "ci_low": 1.1, "ci_high": 1.3, "score": 0.2, "prompts": 4})
    summary = render_run(tiny_run)
    rows = summary_rows((tiny_run / "report.md").read_text())
    assert summary["retime"]["verified_ratio"] == 1.234 and summary["retime"]["claimed_ratio"] == 1.5
    assert rows["Verified (audit retime)"].startswith("**1.234")
    assert "[1.100, 1.300]" in rows["Verified (audit retime)"] and "**0.200**" in rows["Verified (audit retime)"]
    assert "PASS" in rows["Verified (audit retime)"] and rows["Score"].startswith("**0.432**")
    make_retime(tiny_run, verdict="fail", verified={"ratio": 0.9, "ci_low": 0.8, "ci_high": 1.0, "score": 0.0,
                                                    "prompts": 4})
    render_run(tiny_run)
    rows = summary_rows((tiny_run / "report.md").read_text())
    assert "FAIL" in rows["Verified (audit retime)"] and "claim-not-reproduced" in rows["Verified (audit retime)"]
    make_retime(tiny_run, verdict="unverified")
    render_run(tiny_run)
    assert "UNVERIFIED" in summary_rows((tiny_run / "report.md").read_text())["Verified (audit retime)"]
    make_retime(tiny_run, sha="0" * 64, verified={"ratio": 9.0, "ci_low": 9.0, "ci_high": 9.0, "score": 0.9,
                                                  "prompts": 4})
    render_run(tiny_run)
    rows = summary_rows((tiny_run / "report.md").read_text())
    assert "another stream" in rows["Verified (audit retime)"] and "9.0" not in rows["Verified (audit retime)"]


def test_audit_of_another_stream_is_not_shown_as_this_runs(tiny_run):
    make_audit(tiny_run, sha="0" * 64, score=0.99)
    summary = render_run(tiny_run)
    report = (tiny_run / "report.md").read_text()
    assert summary["audit"]["status"] == "mismatch"
    assert report.splitlines()[2] == "> ## ⚠ AUDIT DOES NOT MATCH THIS STREAM"
    assert "treated as NOT AUDITED" in report
    assert summary_rows(report)["Score"].startswith("—")
    # the other stream's score in either form a report gives one (a bare "0.99" can be a leg's time)
    assert "**0.990**" not in report and "0.9900 claimed" not in report


def test_audit_that_could_not_replay_leaves_tokens_unverified(tiny_run):
    # what `audit replay` writes when the model does not match the header: nothing replayed
    audit = make_audit(tiny_run, verdict="fail", exact=False, score=0.0)
    for p in audit["prompts"]:
        p["exact"] = False
    audit["replay"].update(tokens_replayed=0, seconds=0.0, ms_per_token=None)
    audit["findings"] = [{"check": "model", "severity": "fail", "prompt_id": None, "message": "weights differ"}]
    write_json_atomic(tiny_run / "audit.json", audit)
    summary = render_run(tiny_run)
    report = (tiny_run / "report.md").read_text()
    assert {p["verdict"] for p in summary["prompts"]} == {"not replayed"}
    assert summary["first_divergence"] is None
    rows = summary_rows(report)
    assert rows["First divergence"].startswith("none recorded: the audit did not replay")
    assert rows["Exact"] == "**NO**: 3 not replayed (tokens unverified) (audit)"
    assert report.splitlines()[2] == "> ## ⚠ AUDIT FAILED" and "were not replayed" in report
    assert all(row[-1] == "**unverified** (not replayed)" for row in table_rows(report, "Speedup per prompt"))
    assert "no tokens replayed" in report


def test_edited_stream_is_flagged_and_raw_legs_win(tiny_run):
    from core.schema import dumps

    lines = (tiny_run / "stream.jsonl").read_text().splitlines()
    i = next(n for n, line in enumerate(lines) if '"type":"leg"' in line)
    leg = json.loads(lines[i])
    leg["wall_s"] *= 3
    lines[i] = dumps(leg)
    (tiny_run / "stream.jsonl").write_text("\n".join(lines) + "\n")
    summary = render_run(tiny_run)
    assert [b["kind"] for b in summary["banners"]] == ["not-audited", "stream-modified", "harness-disagrees"]
    p = summary["prompts"][0]
    assert p["ratio"]["candidate"] == pytest.approx(raw_ratios(read_records(tiny_run))[p["id"]])
    assert p["ratio"]["candidate"] != pytest.approx(p["harness_ratio"])
    assert "STREAM MODIFIED AFTER WRITING" in (tiny_run / "report.md").read_text()


def test_harness_report_flag(tiny_harness_run):
    run_dir, output = tiny_harness_run
    assert (run_dir / "stream.jsonl").is_file() and (run_dir / "report.md").is_file()
    assert (run_dir / "figures" / "speedup.png").is_file()
    assert f"report: {run_dir / 'report.md'}" in output
    assert "NOT AUDITED" in (run_dir / "report.md").read_text()


def test_harness_report_failure_keeps_the_stream(tiny_run, monkeypatch):
    from harness.commands.time import render_report

    def broken(summary, path):
        raise RuntimeError("no space left")

    monkeypatch.setitem(FIGURES, "speedup", broken)
    with pytest.raises(SystemExit) as exc:
        render_report(tiny_run)
    assert exc.value.code == 1
    assert sorted(p.name for p in tiny_run.iterdir()) == ["stream.jsonl"]


def run_audit_cli(run_dir: Path):
    from audit.cli import main as audit_main

    return CliRunner().invoke(audit_main, ["replay", str(run_dir / "stream.jsonl"), "--device", "cpu"])


def test_audit_refreshes_an_existing_report(tiny_run):
    """`audit replay` re-renders a report.md already beside the stream, so it shows the verdict."""
    render_run(tiny_run)
    assert "NOT AUDITED" in (tiny_run / "report.md").read_text()
    res = run_audit_cli(tiny_run)
    assert res.exit_code in (0, 1), res.output
    assert f"refreshed {tiny_run / 'report.md'}" in res.output
    audit = json.loads((tiny_run / "audit.json").read_text())
    report = (tiny_run / "report.md").read_text()
    rows = summary_rows(report)
    assert "NOT AUDITED" not in report
    assert f"audit verdict: **{audit['verdict'].upper()}**" in rows["Score"]
    assert not list(tiny_run.glob(".report-*"))


def test_audit_report_refresh_failure_is_a_warning(tiny_run):
    render_run(tiny_run)
    before = (tiny_run / "report.md").read_bytes()
    (tiny_run / "audit_tokens.json").write_text("{not json")  # the render now fails on bad input
    res = run_audit_cli(tiny_run)
    assert res.exit_code in (0, 1), res.output  # the audit's own verdict, not a failure of its own
    warnings = [ln for ln in res.output.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "not refreshed" in warnings[0] and "audit_tokens.json" in warnings[0]
    assert (tiny_run / "audit.json").is_file() and (tiny_run / "report.md").read_bytes() == before


def test_audit_without_a_report_writes_none(tiny_run):
    res = run_audit_cli(tiny_run)
    assert res.exit_code in (0, 1) and "refreshed" not in res.output
    assert sorted(p.name for p in tiny_run.iterdir()) == ["audit.json", "stream.jsonl"]


def test_decoders_row_is_brief_and_the_appendix_has_every_setting(tmp_path):
    """A calibration and measured costs in a decoder's config stay out of the summary table."""
    run_dir = write_synthetic_run(tmp_path / "run", audit=False)
    records = read_records(run_dir)
    config = {"calibration": {"gemm": {f"{k}x256": 8 for k in range(64, 2112, 64)}, "max_rows": 8, "device": "cuda"},
              "costs_s": {"draft": 0.00094, "verify": {str(k): 0.005 + k / 1000 for k in range(1, 8)}},
              "depth": None, "explore_every": 64, "graphs": True, "max_depth": 6, "shortlist": "draft_shortlist.json"}
    records[0]["candidate"]["config"] = config
    with AtomicJsonlWriter(run_dir / "stream.jsonl") as w:
        for rec in records[:-1]:
            w.write(rec)
        w.write_end(median_ratio=records[-1]["median_ratio"])
        w.commit()
    render_run(run_dir)
    report = (run_dir / "report.md").read_text()
    decoders = summary_rows(report)["Decoders"]
    assert len(json.dumps(config)) > 700 and len(decoders) < 250, decoders
    assert "**spec-adaptive** (explore_every=64, graphs=True, max_depth=6, shortlist=draft_shortlist.json; " \
           "the full configuration is in the appendix)" in decoders
    assert "calibration" not in decoders and "**serial** (cache=DynamicCache)" in decoders
    appendix = report.split("## Appendix: decoder configurations\n", 1)[1]
    blocks = re.findall(r"### (\w+): (\S+)\n\n```json\n(.*?)\n```", appendix, re.S)
    assert [(role, name) for role, name, _ in blocks] == [("control", "serial"), ("candidate", "spec-adaptive")]
    assert json.loads(blocks[0][2]) == {"cache": "DynamicCache"} and json.loads(blocks[1][2]) == config


# --------------------------------------------------------------------------- the synthetic run


def test_synthetic_run_draws_every_figure(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "synthetic")
    records = read_records(run_dir)
    audit = json.loads((run_dir / "audit.json").read_text())
    summary = render_run(run_dir)
    report = (run_dir / "report.md").read_text()
    assert_figures(summary, run_dir, set(FIGURES))

    # banner and summary: a failing audit with its first divergence, before anything else
    assert report.splitlines()[2] == "> ## ⚠ AUDIT FAILED"
    rows = summary_rows(report)
    div = audit["prompts"][2]["first_divergence"]
    assert f"prompt {LONG_IDS[2]}" in rows["First divergence"]
    assert f"position {div['position']}" in rows["First divergence"]
    assert f"emitted {div['emitted']}, greedy {div['greedy']}" in rows["First divergence"]
    assert summary["first_divergence"]["position"] == div["position"]
    assert rows["Exact"].startswith("**NO**: 1 of 5 prompts")
    assert rows["Score"].startswith("**0.000**") and "FAIL" in rows["Score"]
    median_ratio = statistics.median(raw_ratios(records).values())
    assert first_number(rows["Median ratio"]) == pytest.approx(median_ratio, abs=5e-4)
    assert summary["median_ratio"]["candidate"] == pytest.approx(median_ratio, rel=1e-12)

    # acceptance: summed accept_hist over all candidate legs
    legs = [r for r in records if r["type"] == "leg" and r["role"] == "candidate"]
    rounds = sum(sum(r["stats"]["accept_hist"].values()) for r in legs)
    accepted = sum(r["stats"]["accepted"] for r in legs)
    acc = summary["acceptance"]["candidate"]
    assert acc["rounds"] == rounds
    assert acc["mean_accepted_length"] == pytest.approx((accepted + rounds) / rounds)
    assert f"{acc['mean_accepted_length']:.2f} tokens per verification round" in rows["Mean accepted length"]

    # memory: max over legs, in the table; time split: median over legs
    peaks = {pid: max(r["peak_mem_bytes"] for r in records if r["type"] == "leg" and r["prompt_id"] == pid
                      and r["role"] == "candidate") for pid in LONG_IDS}
    mem_rows = {row[0].strip("`"): row for row in table_rows(report, "Peak memory")}
    for pid, peak in peaks.items():
        assert mem_rows[pid][2] == f"{peak / 2 ** 20:,.1f} MiB"
    p0 = summary["prompts"][0]
    draft = statistics.median(r["stats"]["time_split"]["draft"] for r in legs if r["prompt_id"] == LONG_IDS[0])
    assert p0["time_split"]["candidate"]["draft"] == pytest.approx(draft)
    # plain steps are a phase of their own, never counted as verify
    step = statistics.median(r["stats"]["time_split"]["step"] for r in legs if r["prompt_id"] == LONG_IDS[0])
    assert list(p0["time_split"]["candidate"]) == ["step", "draft", "verify", "rollback", "other"]
    assert p0["time_split"]["candidate"]["step"] == pytest.approx(step)
    assert table_head(report, "Time split of a decode")[2:4] == ["step", "draft"]
    assert "step: plain steps" in report
    assert "### Findings" in report and "warm-up too short?" in report and "warm-leg flag" in report


def test_more_roles_add_series(tmp_path):
    """A third decoder in the legs becomes one more series everywhere, no code change needed."""
    run_dir = write_synthetic_run(tmp_path / "synthetic", audit=False)
    records = read_records(run_dir)
    records[0]["candidate-b"] = {"name": "spec-tree", "config": {"width": 2}}
    extra = []
    for rec in records:
        extra.append(rec)
        if rec["type"] == "leg" and rec["role"] == "candidate":
            extra.append({**rec, "role": "candidate-b", "wall_s": rec["wall_s"] * 0.8})
    run = run_from_records(extra, {"present": True, "count_ok": True, "sha256_ok": True}, "e" * 64, run_dir,
                           run_dir / "stream.jsonl")
    summary = summarize_run(run)
    assert summary["roles"] == ["control", "candidate", "candidate-b"]
    assert summary["median_ratio"]["candidate-b"] == pytest.approx(summary["median_ratio"]["candidate"] / 0.8)
    fig_dir = tmp_path / "figs"
    fig_dir.mkdir()
    drawn = {stem: plot(summary, fig_dir / f"{stem}.png") for stem, plot in FIGURES.items()}
    assert all(drawn.values())
    text = write_report(summary, {s: f"figs/{s}.png" for s in drawn}, tmp_path / "report.md").read_text()
    assert "spec-tree ms/token" in text and "ratio spec-tree (raw legs)" in text


# --------------------------------------------------------------------------- bad inputs


def _truncate(run_dir: Path) -> None:
    lines = (run_dir / "stream.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "stream.jsonl").write_text("".join(lines[:-1]))


def _garble(run_dir: Path) -> None:
    lines = (run_dir / "stream.jsonl").read_text().splitlines(keepends=True)
    lines[3] = lines[3][: len(lines[3]) // 2] + "\n"
    (run_dir / "stream.jsonl").write_text("".join(lines))


def _drop_control_legs(run_dir: Path) -> None:
    # keep the file well-formed (fresh end record) but take away one prompt's control legs
    records = read_records(run_dir)
    first = records[1]["id"]
    kept = [r for r in records[:-1] if not (r["type"] == "leg" and r["prompt_id"] == first and r["role"] == "control")]
    with AtomicJsonlWriter(run_dir / "stream.jsonl") as w:
        for r in kept:
            w.write(r)
        w.write_end(median_ratio=records[-1]["median_ratio"])
        w.commit()


def _bad_stats(run_dir: Path) -> None:
    records = read_records(run_dir)
    leg = next(r for r in records if r["type"] == "leg" and r["role"] == "candidate")
    leg["stats"]["depth_trace"] = "3,3,3"
    (run_dir / "stream.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _audit_text(text: str):
    return lambda run_dir: (run_dir / "audit.json").write_text(text)


def _audit_edit(**changes):
    def edit(run_dir: Path) -> None:
        audit = make_audit(run_dir)
        for k, v in changes.items():
            if v is None:
                audit.pop(k)
            else:
                audit[k] = v
        (run_dir / "audit.json").write_text(json.dumps(audit))
    return edit


BAD_INPUTS = {
    "missing dir": (lambda run_dir: shutil.rmtree(run_dir), "not found"),
    "not a dir": (lambda run_dir: (shutil.rmtree(run_dir), run_dir.write_text("x")), "is not a directory"),
    "missing stream": (lambda run_dir: (run_dir / "stream.jsonl").unlink(), "no stream.jsonl in"),
    "empty stream": (lambda run_dir: (run_dir / "stream.jsonl").write_text(""), "empty file"),
    "malformed stream": (_garble, "line 4: not valid JSON"),
    "truncated stream": (_truncate, "no end record"),
    "partial stream": (_drop_control_legs, "lacks timed legs for the control"),
    "malformed stats": (_bad_stats, "depth_trace must be a list"),
    "audit not json": (_audit_text("{\"schema\": "), "audit.json: not valid JSON"),
    "audit not object": (_audit_text("[1, 2]"), "audit.json: not a JSON object"),
    "audit wrong schema": (_audit_edit(schema="qwen35-exact/audit/0"), "unknown audit schema"),
    "audit lacks score": (_audit_edit(score=None), "lacks 'score'"),
    "audit bad verdict": (_audit_edit(verdict="ok"), "verdict must be 'pass' or 'fail'"),
    "audit bad prompts": (_audit_edit(prompts=[{"id": "x"}]), "lacks 'prompts[0].exact'"),
    "audit foreign prompt": (_audit_edit(prompts=[{"id": "no-such-prompt", "exact": True}]),
                             "names prompt 'no-such-prompt'"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_writes_nothing(tiny_run, case):
    breaker, expected = BAD_INPUTS[case]
    breaker(tiny_run)
    res = render_cli(tiny_run)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], res.output
    if tiny_run.is_dir():
        assert sorted(p.name for p in tiny_run.iterdir()) == sorted(
            n for n in ("stream.jsonl", "audit.json") if (tiny_run / n).exists())


def test_failed_render_keeps_previous_report_and_leaves_no_partial(tiny_run, monkeypatch):
    render_run(tiny_run)
    before = (tiny_run / "report.md").read_bytes()

    def broken(summary, path):
        path.write_bytes(b"half a png")
        raise RuntimeError("disk full")

    monkeypatch.setitem(FIGURES, "acceptance", broken)
    make_audit(tiny_run)  # new input, so a successful render would change the report
    res = render_cli(tiny_run)
    assert res.exit_code == 2
    assert res.output.startswith("error: could not render") and "RuntimeError: disk full" in res.output
    assert (tiny_run / "report.md").read_bytes() == before
    assert (tiny_run / "figures" / "acceptance.png").read_bytes()[:8] == PNG_MAGIC
    assert not list(tiny_run.glob(".report-*"))

    (tiny_run / "report.md").unlink()
    shutil.rmtree(tiny_run / "figures")
    assert render_cli(tiny_run).exit_code == 2
    assert sorted(p.name for p in tiny_run.iterdir()) == ["audit.json", "stream.jsonl"]


def test_rerender_replaces_figures(tiny_run):
    """A figure an earlier render drew and this one does not (no token audit now) goes."""
    render_run(tiny_run)
    (tiny_run / "figures" / "token_margins.png").write_bytes(PNG_MAGIC)
    summary = render_run(tiny_run)
    assert sorted(p.stem for p in (tiny_run / "figures").iterdir()) == sorted(summary["figures"])
    assert sorted(p.name for p in tiny_run.iterdir()) == ["figures", "report.md", "stream.jsonl"]


def test_help_explains():
    res = CliRunner().invoke(reports_main, ["render", "--help"])
    assert res.exit_code == 0
    for phrase in ("RUN_DIR/report.md", "stream.jsonl", "audit.json", "NOT AUDITED", "exit status 2"):
        assert phrase in res.output


def test_figures_use_agg_without_pyplot():
    fig = figures_mod.new_figure(2.0)
    assert type(fig.canvas).__name__ == "FigureCanvasAgg"


def table_head(report: str, section: str) -> list[str]:
    """The header cells of the first table in ``section``."""
    body = report.split(f"## {section}", 1)[1]
    line = next(ln for ln in body.splitlines() if ln.startswith("|"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_time_split_figure_names_steps_apart_from_verify(monkeypatch):
    """The figure's legend says which phase is plain steps and which the verify windows."""
    saved = {}
    monkeypatch.setattr(figures_mod, "save", lambda fig, path: saved.setdefault("fig", fig) is fig)
    split = {"step": 0.004, "draft": 0.002, "verify": 0.006, "other": 0.001}
    summary = {"prompts": [{"id": "p", "time_split": {"candidate": split}}], "roles": ["candidate"],
               "labels": {"candidate": "spec"}}
    monkeypatch.setattr(figures_mod, "role_label", lambda s, r: "spec")
    assert figures_mod.plot_time_split(summary, Path("unused.png"))
    legend = saved["fig"].legends[0] if saved["fig"].legends else saved["fig"].axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["step (plain steps)", "draft", "verify (windows)", "other"]


def _tokens_doc(gens: list, tie_margin: dict) -> dict:
    return {"tie_margin": tie_margin, "counts": {"generations": len(gens)},
            "generations": [{"first_divergence": d} for d in gens]}


NEAR = {"class": "near-tie", "gap": 0.03, "margin": 0.03, "tolerance": 0.0625}
REAL = {"class": "real", "gap": 0.5, "margin": 0.2, "tolerance": 0.125}
STOP = {"class": "stop", "gap": None, "margin": None, "tolerance": None, "stop": "ran past an EOS"}
ULPS = {"mode": "ulps", "ulps": 4, "dtype": "bfloat16"}


@pytest.mark.parametrize("tie_margin, lines", [(ULPS, [0.0625, 0.125]), ({"mode": "fixed", "value": 0.05}, [0.05])])
def test_margins_figure_draws_the_tolerance_and_the_stops(tie_margin, lines):
    from reports.tokens import margins_figure

    fig = margins_figure(_tokens_doc([NEAR, REAL, STOP, None], tie_margin))
    ax = fig.axes[0]
    assert sorted(line.get_xdata()[0] for line in ax.lines) == lines  # the tolerance the classes were decided by
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0:2] == ["near-tie (1)", "real (1)"] and labels[-1] == "stop (1): wrong stop, no gap"
    assert any(label.startswith("tie tolerance (") for label in labels)
    assert "stop" in [t.get_text() for t in ax.get_xticklabels()]
    assert "3 of 4 generations" in ax.get_title()


def test_margins_figure_for_stops_alone_and_for_nothing():
    from reports.tokens import margins_figure

    fig = margins_figure(_tokens_doc([STOP, STOP], ULPS))
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["near-tie (0)", "real (0)",
                                                                           "stop (2): wrong stop, no gap"]
    assert margins_figure(_tokens_doc([None], ULPS)) is None


# --------------------------------------------------------------------------- sampled runs


def test_sampled_run_reports_its_sampler_and_acceptance_under_it(tmp_path):
    """A stream recorded under `harness time --sampling`: the summary names the sampler, the
    acceptance table and figure say which temperature the drafts were accepted at, and the audited
    exactness is against serial sampling; a greedy run says greedy."""
    from audit.cli import main as audit_main
    from harness.cli import main as harness_main

    out = tmp_path / "sampled"
    res = CliRunner().invoke(harness_main, ["time", "--model", "tiny", "--decoder", "spec", "--decoder-arg", "depth=2",
                                            "--device", "cpu", "--limit", "2", "-n", "12", "--legs", "1",
                                            "--sampling", "temperature=0.6,top_k=20,top_p=0.95,seed=3",
                                            "--out", str(out)])
    assert res.exit_code == 0, res.output
    (banner,) = render_run(out)["banners"]  # before the audit: what is not yet checked is serial sampling
    assert "not been checked against serial sampling under `temperature=0.6,top_k=20,top_p=0.95,seed=3`" in banner["text"]
    res = CliRunner().invoke(audit_main, ["replay", str(out / "stream.jsonl")])
    assert res.exit_code == 0, res.output
    summary = render_run(out)
    report = (out / "report.md").read_text()
    assert summary["sampler"]["temperature"] == 0.6 and not summary["sampler"]["greedy"]
    rows = summary_rows(report)
    assert rows["Sampling"].startswith("`temperature=0.6,top_k=20,top_p=0.95,seed=3` (gumbel-max/v2)")
    assert "equal serial sampling (temperature=0.6,top_k=20,top_p=0.95,seed=3)" in rows["Exact"]
    assert "temperature 0.6" in rows["Mean accepted length"]
    assert table_head(report, "Draft acceptance")[:2] == ["decoder", "sampler"]
    (row,) = table_rows(report, "Draft acceptance")
    assert row[1] == "temperature 0.6"
    assert "equals the sampler's pick" in report


def test_greedy_run_says_greedy(tiny_run):
    summary = render_run(tiny_run)
    report = (tiny_run / "report.md").read_text()
    assert summary["sampler"]["greedy"] and summary_rows(report)["Sampling"] == "greedy (argmax)"
    assert all(row[1] == "greedy" for row in table_rows(report, "Draft acceptance"))


def test_a_header_sampler_that_defines_none_is_one_line(tiny_run):
    from audit_helpers import write_records

    records = read_records(tiny_run)
    records[0]["sampler"] = {"name": "gumbel-max/v2", "temperature": -2}
    write_records(tiny_run / "stream.jsonl", records)  # resealed
    res = render_cli(tiny_run)
    assert res.exit_code == 2 and "header sampler" in res.output, res.output
    assert not (tiny_run / "report.md").exists()


def test_a_render_replaces_only_its_own_files(tiny_run):
    """The user's report.md is refused before any work; their files in figures/ stay; a report
    the tool wrote is replaced, and a figure it no longer draws goes."""
    (tiny_run / "report.md").write_text("my notes\n")
    with pytest.raises(UserError, match="not a report `reports render` wrote"):
        render_run(tiny_run)
    assert (tiny_run / "report.md").read_text() == "my notes\n"
    (tiny_run / "report.md").unlink()
    (tiny_run / "figures").mkdir()
    (tiny_run / "figures" / "holiday.png").write_text("x")
    (tiny_run / "figures" / "token_margins.png").write_text("an earlier render's")
    render_run(tiny_run)
    render_run(tiny_run)  # its own report: replaced
    left = sorted(p.name for p in (tiny_run / "figures").iterdir())
    assert "holiday.png" in left and "token_margins.png" not in left and "ms_per_token.png" in left
    (tiny_run / "report.md").unlink()
    (tiny_run / "figures").rename(tiny_run / "figs")
    (tiny_run / "figures").write_text("a file")
    with pytest.raises(UserError, match="not a directory of figures"):
        render_run(tiny_run)
