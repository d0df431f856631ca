"""Helpers for the audit tests: run the harness and the audit in-process, edit streams.

``reseal`` recomputes the end record's count and sha256 after an edit, as a careful forger
would, so a test proves the audit catches the edit itself and not only the broken seal.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from click.testing import CliRunner

from core.schema import dumps


def run_harness(out_dir: Path, decoder: str, *, limit: int = 2, n: int = 12, legs: int = 2,
                extra: tuple = ()) -> Path:
    from harness.cli import main as harness_main

    args = ["time", "--decoder", decoder, "--model", "tiny", "--device", "cpu", "--out", str(out_dir),
            "--limit", str(limit), "-n", str(n), "--legs", str(legs), *extra]
    result = CliRunner().invoke(harness_main, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return out_dir / "stream.jsonl"


def run_audit(stream: Path, *args: str, out: Path | None = None):
    """Returns (click Result, audit.json document or None)."""
    from audit.cli import main as audit_main

    out = out or stream.parent / "audit.json"
    result = CliRunner().invoke(audit_main, ["replay", str(stream), "--out", str(out), *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    doc = json.loads(out.read_text()) if out.exists() else None
    return result, doc


def copy_stream(src: Path, dst_dir: Path) -> Path:
    dst_dir.mkdir(parents=True, exist_ok=True)
    dst = dst_dir / "stream.jsonl"
    shutil.copy(src, dst)
    return dst


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_records(path: Path, records: list[dict], reseal: bool = True) -> None:
    """Write records back; with ``reseal`` the end record's count/sha256 match the new body."""
    lines = [dumps(r) + "\n" for r in records]
    if reseal and records and records[-1]["type"] == "end":
        body = lines[:-1]
        end = dict(records[-1], records=len(body), sha256=hashlib.sha256("".join(body).encode()).hexdigest())
        lines = body + [dumps(end) + "\n"]
    path.write_text("".join(lines))


def legs_of(records: list[dict], prompt_id: str) -> list[dict]:
    return [r for r in records if r["type"] == "leg" and r["prompt_id"] == prompt_id]


def find_leg(records: list[dict], prompt_id: str, role: str, leg: int) -> dict:
    return next(r for r in legs_of(records, prompt_id) if r["role"] == role and r["leg"] == leg)


def prompt_ids(records: list[dict]) -> list[str]:
    return [r["id"] for r in records if r["type"] == "prompt"]


def findings(doc: dict, check: str, prompt_id: str | None = ..., severity: str | None = None) -> list[dict]:
    return [f for f in doc["findings"] if f["check"] == check
            and (prompt_id is ... or f["prompt_id"] == prompt_id)
            and (severity is None or f["severity"] == severity)]


def claim_refused(doc: dict) -> bool:
    """A retime that did not let a stream's claim stand: it failed it (claim-not-reproduced), or
    found its own interval too wide to judge by (too-noisy-to-verify: UNVERIFIED, or FAIL where
    another check failed the retime too)."""
    noisy = bool(findings(doc, "too-noisy-to-verify", severity="warn"))
    if doc["verdict"] == "unverified":
        return noisy
    return doc["verdict"] == "fail" and (noisy or bool(findings(doc, "claim-not-reproduced", severity="fail")))


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def retime(records: list[dict], control_s: float, candidate_s, peaks: dict | None = None) -> None:
    """A consistent forgery (or a steady candidate): every leg gets a fixed wall time
    (``candidate_s`` may also map a leg number to its time, or be a function of the leg record),
    laid out back to back in the order
    legs ran; summaries and the end's median are recomputed the harness's way. ``peaks``
    optionally sets peak_mem_bytes per role. Edits ``records`` in place; reseal when writing."""
    import statistics

    from harness.timing import summarize_prompt

    t = 1.0
    for r in records:
        if r["type"] == "leg":
            cand = (candidate_s[r["leg"]] if isinstance(candidate_s, dict) else
                    candidate_s(r) if callable(candidate_s) else candidate_s)
            r["t_start"] = t
            r["t_end"] = t + (control_s if r["role"] == "control" else cand)
            r["wall_s"] = r["t_end"] - r["t_start"]
            t = r["t_end"] + 0.001
            if peaks:
                r["peak_mem_bytes"] = peaks[r["role"]]
    ratios = []
    for i, r in enumerate(records):
        if r["type"] == "summary":
            fresh = summarize_prompt(r["prompt_id"], legs_of(records, r["prompt_id"]))
            fresh["same_tokens_as_control"] = r["same_tokens_as_control"]
            records[i] = fresh
            ratios.append(fresh["ratio"])
        elif r["type"] == "end":
            r["median_ratio"] = statistics.median(ratios)


def shorten_candidate(records: list[dict], factor: float) -> None:
    """The forger's edit that only a retime catches: every candidate leg takes ``factor`` of its
    time (its end moved back, so the leg intervals stay disjoint and in order), and the
    summaries and the end's median are recomputed the harness's way. Reseal when writing."""
    import statistics

    from harness.timing import summarize_prompt

    for r in records:
        if r["type"] == "leg" and r["role"] == "candidate":
            r["t_end"] = r["t_start"] + r["wall_s"] * factor
            r["wall_s"] = r["t_end"] - r["t_start"]
    ratios = []
    for i, r in enumerate(records):
        if r["type"] == "summary":
            records[i] = {**r, **summarize_prompt(r["prompt_id"], legs_of(records, r["prompt_id"]))}
            ratios.append(records[i]["ratio"])
        elif r["type"] == "end":
            r["median_ratio"] = statistics.median(ratios)


def forge_stream(src: Path, dst_dir: Path, factor: float = 0.25) -> Path:
    """A resealed copy of ``src`` whose candidate legs were shortened by ``factor``."""
    dst = copy_stream(Path(src), Path(dst_dir))
    records = read_records(dst)
    shorten_candidate(records, factor)
    write_records(dst, records)
    return dst


if __name__ == "__main__":  # `python tests/audit_helpers.py forge SRC DST_DIR [FACTOR]`, for .ci/run
    import sys

    if len(sys.argv) not in (4, 5) or sys.argv[1] != "forge":
        sys.exit("usage: python tests/audit_helpers.py forge SRC_STREAM DST_DIR [FACTOR]")
    print(forge_stream(Path(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4]) if len(sys.argv) == 5 else 0.25))


def edit(stream: Path, fn, reseal: bool = True) -> list[dict]:
    """Apply ``fn`` to the stream's records in place and write them back (resealed: the end
    record's count and sha256 recomputed, as a careful forger would). Returns the records."""
    records = read_records(stream)
    fn(records)
    write_records(stream, records, reseal=reseal)
    return records
