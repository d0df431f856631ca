"""The suite's parts and what their logs say: which tests a run cut by its time limit reached, so
that a later call runs only the rest (``python bench/run.py suite --resume``)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# --configs of `suite`, in halves or thirds: one 10-minute GPU call may not hold it all, and a call
# that starts with less device time left may not hold half
SUITE_SPLITS = (2, 3)
SUITE_PARTS = tuple(f"{k}of{n}" for n in SUITE_SPLITS for k in range(1, n + 1))

OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
FAILURES = ("FAILED", "ERROR")
_OUTCOME = "|".join(OUTCOMES)
# pytest -v names a test as it ends: "[gw3] [ 42%] PASSED tests/a.py::t[x y]" under pytest-xdist,
# "tests/a.py::t[x y] PASSED    [ 42%]" in one process
_XDIST_LINE = re.compile(rf"^\[gw\d+\] \[ *\d+%\] ({_OUTCOME}) (tests/\S.*?)\s*$")
_PLAIN_LINE = re.compile(rf"^(tests/\S.*?) ({_OUTCOME})\s+\[ *\d+%\]\s*$")


def suite_files(part: str | None) -> list[str]:
    """Part k of n (``"KofN"``) of the suite: every n-th test file in name order from the k-th, so
    that the n parts hold every file once; for the whole suite (None), no file named."""
    if part is None:
        return []
    k, n = (int(x) for x in part.split("of"))
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py"))
    return files[k - 1::n]


def reached(log: str) -> dict[str, str]:
    """Each test a ``pytest -v`` log names as ended, with its outcome; a test with more than one
    (a call that passed, then a teardown error) keeps its failure."""
    outcomes: dict[str, str] = {}
    for line in log.splitlines():
        if m := _XDIST_LINE.match(line):
            outcome, test = m.groups()
        elif m := _PLAIN_LINE.match(line):
            test, outcome = m.groups()
        else:
            continue
        keep_failure(outcomes, test, outcome)
    return outcomes


def keep_failure(outcomes: dict[str, str], test: str, outcome: str) -> None:
    if outcomes.get(test) not in FAILURES:
        outcomes[test] = outcome


def part_logs(logs: Path, key: str) -> list[Path]:
    """The logs of step ``key`` in ``logs``: its first run's, then each later run's of its rest
    (``KEY-restN.log``, in N's order)."""
    rests = sorted((n, p) for p in logs.glob(f"{key}-rest*.log") if (n := rest_number(p, key)))
    first = logs / f"{key}.log"
    return ([first] if first.is_file() else []) + [p for _, p in rests]


def rest_number(path: Path, key: str) -> int:
    """N of a log named ``KEY-restN.log``; 0 for any other name."""
    tail = path.stem[len(f"{key}-rest"):]
    return int(tail) if tail.isdigit() else 0


def next_rest(logs: list[Path], key: str) -> str:
    """The key of the next run of step ``key``'s rest: one past the highest N among ``logs``, so
    that no log already there is written over."""
    return f"{key}-rest{max((rest_number(p, key) for p in logs), default=0) + 1}"


def collected(pytest: tuple[str, ...], files: list[str]) -> list[str]:
    """The test ids pytest collects from ``files`` (the whole suite where none are named), in its
    order. Raises RuntimeError with pytest's last lines when collection fails."""
    done = subprocess.run([*pytest, "--collect-only", "-q", *files], cwd=ROOT, capture_output=True, text=True)
    ids = [line.strip() for line in done.stdout.splitlines() if line.startswith("tests/") and "::" in line]
    if done.returncode != 0 or not ids:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
        raise RuntimeError(f"pytest could not collect the tests (exit {done.returncode}):\n{tail}")
    return ids


def rest(ids: list[str], logs: list[Path]) -> tuple[list[str], list[str]]:
    """The ``ids`` that no log in ``logs`` reached, in collection order, and the tests those logs
    name as failed or in error (never run again: a failure stays on the record)."""
    ended: dict[str, str] = {}
    for log in logs:
        for test, outcome in reached(log.read_text(encoding="utf-8", errors="replace")).items():
            keep_failure(ended, test, outcome)
    failed = sorted(test for test, outcome in ended.items() if outcome in FAILURES)
    return [t for t in ids if t not in ended], failed
