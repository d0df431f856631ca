"""Speculative decoding benchmark: every configuration timed against the control, every stream audited.

    python bench/spec_bench.py --out DIR [--model synthetic-9b] [--limit 4] [-n 256] [--legs 1]
                               [--configs fast-serial,spec-naive,spec,inst-0.6,inst-0.85,inst-0.95]
                               [--shortlist FILE] [--table-only]

Each configuration is one `harness time` run (candidate vs the serial control, side by side in one
process) followed by `audit replay` of its stream, in DIR/<config>/. The table is built from the
audits (ratios recomputed from raw legs, exactness by replay) and the streams (mean accepted
length, peak memory). "vs fast-serial" comes from NAME@fs runs, where the candidate is timed side by
side against fast-serial (`harness time --control fast-serial`; still audited for exactness
against serial greedy decoding, not scored); without one it is the ratio of the two ratios against
serial, measured in different processes, and marked so.
Configurations can be run in several calls (a GPU call is limited to 10 minutes); --table-only
prints the table from whatever is in DIR.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

BASE = {
    "fast-serial": ["--decoder", "fast-serial"],
    "spec-naive": ["--decoder", "spec-naive"],
    "spec": ["--decoder", "spec"],
    "inst-0.6": ["--decoder", "spec-instrument", "--decoder-arg", "alpha=0.6"],
    "inst-0.85": ["--decoder", "spec-instrument", "--decoder-arg", "alpha=0.85"],
    "inst-0.95": ["--decoder", "spec-instrument", "--decoder-arg", "alpha=0.95"],
}
SHORTLISTED = {"spec", "inst-0.6", "inst-0.85", "inst-0.95"}
# NAME@fs: the same candidate timed side by side against fast-serial (harness time --control)
CONFIGS = {**BASE, **{f"{n}@fs": [*BASE[n], "--control", "fast-serial"] for n in BASE if n in SHORTLISTED}}
DEFAULT_CONFIGS = [*BASE, *(f"{n}@fs" for n in sorted(SHORTLISTED))]


def run_config(name: str, args) -> int:
    out = args.out / name
    cmd = [sys.executable, "-m", "harness.cli", "time", *CONFIGS[name], "--model", args.model,
           "--prompts", args.prompts, "--limit", str(args.limit), "-n", str(args.max_new_tokens),
           "--legs", str(args.legs), "--out", str(out), "--force"]
    if args.shortlist and name.split("@")[0] in SHORTLISTED:
        cmd += ["--decoder-arg", f"shortlist={args.shortlist}"]
    print("$", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd)
    if rc != 0 or args.no_audit:
        return rc
    audit = [sys.executable, "-m", "audit", "replay", str(out / "stream.jsonl")]
    print("$", " ".join(audit), flush=True)
    return subprocess.call(audit)


def row(name: str, run_dir: Path) -> dict | None:
    audit_path, stream_path = run_dir / "audit.json", run_dir / "stream.jsonl"
    if not audit_path.is_file() or not stream_path.is_file():
        return None
    audit = json.loads(audit_path.read_text())
    records = [json.loads(line) for line in stream_path.read_text().splitlines()]
    header, legs = records[0], [r for r in records if r.get("type") == "leg"]

    def ms_per_token(role):
        per_prompt = {}
        for r in legs:
            if r["role"] == role and r["tokens"]:
                per_prompt.setdefault(r["prompt_id"], []).append(1e3 * r["wall_s"] / len(r["tokens"]))
        return statistics.median(statistics.median(v) for v in per_prompt.values())

    lengths = [r["stats"].get("mean_accepted_length") for r in legs if r["role"] == "candidate"]
    lengths = [x for x in lengths if x is not None]
    mem = audit.get("memory", {})
    return {
        "config": name,
        "gpu": (header.get("device", {}).get("uuid") or "?").removeprefix("GPU-")[:8],
        "control_ms": ms_per_token("control"),
        "candidate_ms": ms_per_token("candidate"),
        "ratio": audit.get("median_ratio"),
        "exact": audit.get("exact"),
        "verdict": audit.get("verdict"),
        "instrument": audit.get("instrument"),
        "control_peak": mem.get("control_peak_bytes"),
        "candidate_peak": mem.get("candidate_peak_bytes"),
        "mean_accepted_length": statistics.mean(lengths) if lengths else None,
    }


def accepted_and_exact(r: dict) -> tuple[str, str]:
    """The mean-accepted-length and audit cells of a row."""
    mal = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
    return mal, ("yes" if r["exact"] else "NO") + (" (instrument)" if r["instrument"] else "")


def print_table(rows: list[dict]) -> None:
    """One line per candidate vs serial; "vs fast-serial" is the side-by-side NAME@fs run where
    there is one, else (marked ~) the ratio of the two ratios against serial."""
    base = next((r["ratio"] for r in rows if r["config"] == "fast-serial"), None)
    fs_runs = [r for r in rows if r["config"].endswith("@fs")]
    side = {r["config"].split("@")[0]: r["ratio"] for r in fs_runs}
    rows = [r for r in rows if not r["config"].endswith("@fs")]
    gib = lambda b: "n/a" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    print("\n| config | GPU | control ms/tok | ms/tok | vs control | vs fast-serial (side by side; ~ = ratio of ratios) | "
          "peak GiB (ctl / cand) | mean acc. len | exact (audit) |")
    print("|---|---|---|---|---|---|---|---|---|")
    timed = [r for r in rows if r["control_ms"] is not None]
    if timed:  # the control's own row: its legs pooled over every configuration's run
        ctl_ms = statistics.median(r["control_ms"] for r in timed)
        peak = max((r["control_peak"] for r in timed if r["control_peak"] is not None), default=None)
        gpus = ", ".join(sorted({r["gpu"] for r in timed}))
        print(f"| serial (control, {len(timed)} runs) | {gpus} | {ctl_ms:.2f} | {ctl_ms:.2f} | 1.00x | "
              f"{'-' if base is None else f'~{1 / base:.2f}x'} | {gib(peak)} / - | - | (defines exact) |")
    for r in rows:
        if r["config"] in side and side[r["config"]] is not None:
            vs_fast = f"{side[r['config']]:.2f}x"
        else:
            vs_fast = "-" if base is None or r["ratio"] is None else f"~{r['ratio'] / base:.2f}x"
        mal, exact = accepted_and_exact(r)
        print(f"| {r['config']} | {r['gpu']} | {r['control_ms']:.2f} | {r['candidate_ms']:.2f} | {r['ratio']:.2f}x | {vs_fast} | "
              f"{gib(r['control_peak'])} / {gib(r['candidate_peak'])} | {mal} | {exact} |")
    for r in fs_runs:  # the side-by-side runs themselves: their reference is fast-serial, not serial
        mal, exact = accepted_and_exact(r)
        print(f"| {r['config']} | {r['gpu']} | {r['control_ms']:.2f} (fast-serial) | {r['candidate_ms']:.2f} | - | "
              f"{r['ratio']:.2f}x | {gib(r['control_peak'])} / {gib(r['candidate_peak'])} | {mal} | {exact} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="synthetic-9b")
    ap.add_argument("--prompts", default="random-512")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=256)
    ap.add_argument("--legs", type=int, default=1)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    ap.add_argument("--shortlist", default=None, help="draft shortlist JSON for spec and the instruments")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--no-audit", action="store_true",
                    help="time only; audit later, e.g. every stream at once: audit replay DIR/*/stream.jsonl")
    args = ap.parse_args()
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        print(f"error: unknown configs {unknown}; known: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    failed = []
    if not args.table_only:
        for name in names:
            if run_config(name, args) not in (0, 1):  # 1 = audit findings: still tabulated
                failed.append(name)
    rows = [r for r in (row(n, args.out / n) for n in CONFIGS) if r is not None]
    print_table(rows)
    if failed:
        print(f"failed to run: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
