"""Honest runs through the whole audit on the CPU, as a user makes them, with their verdicts side by side.

    python bench/cpu_verify.py retimes --out DIR [--runs 5] [--jobs 4]
    python bench/cpu_verify.py quickstarts --out DIR [--runs 10] [--jobs 1] [--hogs 1]

retimes      for each of tiny and small, and each of spec and fast-serial: ``--runs`` honest
             streams (``harness time``), each retimed (``audit retime``); a table of every run's
             claimed ratio, verified ratio, interval, score and verdict, then the count of PASS.
quickstarts  ``--hogs`` processes that spin on a core for the whole set (a steady CPU hog), and
             beside them ``--runs`` quick starts: the README's ``harness time`` with its defaults
             (spec on small), then ``audit replay`` and ``audit retime`` of its stream; a table of
             each run's replay verdict (never FAIL for an honest run) and retime verdict (PASS, or
             UNVERIFIED with too-noisy-to-verify: never claim-not-reproduced).

``--jobs`` runs that many runs at once (each run single-threaded: ``OMP_NUM_THREADS=1``). Every
command goes to DIR/RUN/commands.txt with its output in DIR/RUN/*.log. The tables come last.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent
RETIME_CASES = [(model, decoder) for model in ("tiny", "small") for decoder in ("spec", "fast-serial")]
# per model: prompts x new tokens for the retimes' streams (tiny is fast: more of both)
SIZES = {"tiny": ("6", "32"), "small": ("4", "32")}
HOG = "while True: pass"


def run(cmd: list[str], run_dir: Path, key: str) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(run_dir / "commands.txt", "a") as f:
        f.write(" ".join(cmd) + "\n")
    with open(run_dir / f"{key}.log", "w") as log:
        return subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def one_retime(out: Path, model: str, decoder: str, i: int) -> dict:
    d = out / f"{model}-{decoder}-{i}"
    d.mkdir(parents=True, exist_ok=True)
    limit, n = SIZES[model]
    t0 = time.time()
    code = run([PY, "-m", "harness", "time", "--model", model, "--decoder", decoder, "--device", "cpu",
                "--prompts", "dev" if model == "tiny" else "stdlib-heldout", "--limit", limit, "-n", n,
                "--legs", "2", "--force", "--out", str(d)], d, "time")
    rcode = run([PY, "-m", "audit", "retime", str(d / "stream.jsonl"), "--out", str(d / "retime.json")], d, "retime") \
        if code == 0 else None
    return {"run": d.name, "time_rc": code, "retime_rc": rcode, "retime": load(d / "retime.json"),
            "seconds": time.time() - t0}


def one_quickstart(out: Path, i: int) -> dict:
    d = out / f"quickstart-{i}"
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    code = run([PY, "-m", "harness", "time", "--force", "--out", str(d)], d, "time")
    stream = d / "stream.jsonl"
    replay = run([PY, "-m", "audit", "replay", str(stream), "--out", str(d / "audit.json")], d, "replay") \
        if code == 0 else None
    retime = run([PY, "-m", "audit", "retime", str(stream), "--out", str(d / "retime.json")], d, "retime") \
        if code == 0 else None
    return {"run": d.name, "time_rc": code, "replay_rc": replay, "retime_rc": retime,
            "audit": load(d / "audit.json"), "retime": load(d / "retime.json"), "seconds": time.time() - t0}


def fails(doc: dict | None) -> str:
    if not doc:
        return ""
    names = sorted({f["check"] for f in doc["findings"] if f["severity"] == "fail"})
    warns = sorted({f["check"] for f in doc["findings"] if f["check"] == "too-noisy-to-verify"})
    return ", ".join(names + warns)


def retime_cells(doc: dict | None) -> str:
    if not doc:
        return "- | - | - | - | no retime.json"
    v = doc.get("verified") or {}
    ci = f"[{v['ci_low']:.3f}, {v['ci_high']:.3f}]" if v.get("ci_low") is not None else "-"
    ratio = f"{v['ratio']:.3f}" if v.get("ratio") is not None else "-"
    return (f"{doc['claimed']['ratio']:.3f} | {ratio} | {ci} | {v.get('score') or 0:.3f} | "
            f"{doc['verdict'].upper()} {fails(doc)}")


def retimes(args) -> int:
    cases = [(m, dec, i) for m, dec in RETIME_CASES for i in range(1, args.runs + 1)]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda c: one_retime(args.out, *c), cases))
    print("| run | claimed | verified | 95% interval | verified score | verdict | s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['run']} | {retime_cells(r['retime'])} | {r['seconds']:.0f} |")
    passed = sum(1 for r in results if r["retime"] and r["retime"]["verdict"] == "pass")
    print(f"\n{passed} of {len(results)} honest retimes PASS")
    return 0 if passed == len(results) else 1


def quickstarts(args) -> int:
    hogs = [subprocess.Popen([PY, "-c", HOG]) for _ in range(args.hogs)]
    try:
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda i: one_quickstart(args.out, i), range(1, args.runs + 1)))
    finally:
        for h in hogs:
            h.kill()
    print(f"| run (beside {args.hogs} CPU hog(s), {args.jobs} at once, {multiprocessing.cpu_count()} CPUs) | "
          "replay verdict | claimed (replay) | retime: claimed | verified | 95% interval | verified score | "
          "verdict | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    bad = 0
    for r in results:
        a = r["audit"]
        replay = f"{a['verdict'].upper()} {fails(a)}" if a else "no audit.json"
        ratio = f"{a['median_ratio']:.3f}" if a and a.get("median_ratio") is not None else "-"
        bad += (not a or a["verdict"] == "fail" or not r["retime"]
                or any(f["check"] == "claim-not-reproduced" for f in r["retime"]["findings"]))
        print(f"| {r['run']} | {replay} | {ratio} | {retime_cells(r['retime'])} | {r['seconds']:.0f} |")
    print(f"\n{len(results) - bad} of {len(results)} quick starts: replay not FAIL and no claim-not-reproduced")
    return 0 if bad == 0 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("retimes", "quickstarts"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=None, help="runs per case (retimes: 5, quickstarts: 10)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once")
    ap.add_argument("--hogs", type=int, default=1, help="quickstarts: CPU hogs beside the runs")
    args = ap.parse_args()
    args.runs = args.runs or (5 if args.what == "retimes" else 10)
    args.out.mkdir(parents=True, exist_ok=True)
    return retimes(args) if args.what == "retimes" else quickstarts(args)


if __name__ == "__main__":
    sys.exit(main())
