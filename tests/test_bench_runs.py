"""bench/runs/ holds only what bench/NOTES.md cites, and stays small enough to clone."""
from __future__ import annotations

from pathlib import Path

RUNS = Path(__file__).resolve().parent.parent / "bench" / "runs"
NOTES = RUNS.parent / "NOTES.md"
LIMIT_BYTES = 2_000_000
KEPT_SUFFIXES = {".json", ".jsonl", ".log", ".png"}


def files() -> list[Path]:
    return [p for p in RUNS.rglob("*") if p.is_file()]


def test_bench_runs_stays_under_two_megabytes():
    total = sum(p.stat().st_size for p in files())
    assert total <= LIMIT_BYTES, f"bench/runs holds {total:,} bytes, more than {LIMIT_BYTES:,}"


def test_every_kept_run_is_cited_in_the_notes():
    notes = NOTES.read_text()
    uncited = [d.name for d in RUNS.iterdir() if d.is_dir() and f"runs/{d.name}" not in notes]
    assert not uncited, f"runs that NOTES.md does not cite: {uncited}"


def test_runs_are_records_not_scripts():
    odd = [str(p.relative_to(RUNS)) for p in files() if p.suffix not in KEPT_SUFFIXES]
    assert not odd, f"bench/runs keeps streams, audits and their logs, not {odd}"
