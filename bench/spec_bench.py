"""Speculative decoding benchmark: every configuration timed against the control, every stream audited.

    python bench/spec_bench.py --out DIR [--model synthetic-9b] [--limit 4] [-n 256] [--legs 1]
                               [--configs NAME,NAME,...] [--shortlist FILE] [--table-only]

Each configuration is one `harness time` run (candidate vs the serial control, side by side in one
process) followed by `audit replay` of its stream, in DIR/<config>/ (':' and '/' in a name become
'_'). The table is built from the audits (ratios recomputed from raw legs, exactness by replay) and
the streams (mean accepted length, acceptance by depth, peak memory). "vs fast-serial" comes from
NAME@fs runs, where the candidate is timed side by side against fast-serial (`harness time
--control fast-serial`; still audited for exactness against serial greedy decoding, not scored);
without one it is the ratio of the two ratios against serial, measured in different processes,
and marked so.

Configuration names:
  fast-serial, spec-naive, spec, inst-A      a decoder (inst-A: the instrument at alpha A)
  fs-read-first                              fast-serial reading each token before queuing the next
                                             step (fs-read-first@fs: what reading ahead gains)
  inst-trace:FILE                            the instrument replaying an acceptance trace
                                             (python -m decoders.trace ... --out FILE)
  small:NAME                                 NAME on the built-in `small` and its held-out prompts
                                             (on a GPU: its real head's acceptance), whatever --model
  NAME+conf                                  NAME (spec or the instrument) with stop=confidence
  NAME@fs                                    NAME timed side by side against fast-serial
For the acceptance curve of one model on a GPU, e.g.:
    --configs fast-serial,inst-0.6,inst-0.85,inst-0.95,inst-trace:small-trace.json,spec,small:fast-serial,small:spec,small:spec@fs,inst-trace:small-trace.json@fs
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

from core.schema import read_stream

BASE = {
    "fast-serial": ["--decoder", "fast-serial"],
    # fast-serial reading each token before it queues the next step (against fast-serial: the read-ahead's gain)
    "fs-read-first": ["--decoder", "fast-serial", "--decoder-arg", "read_ahead=false"],
    "spec-naive": ["--decoder", "spec-naive"],
    "spec": ["--decoder", "spec"],
    "inst-0.6": ["--decoder", "spec-instrument", "--decoder-arg", "alpha=0.6"],
    "inst-0.7": ["--decoder", "spec-instrument", "--decoder-arg", "alpha=0.7"],
    "inst-0.85": ["--decoder", "spec-instrument", "--decoder-arg", "alpha=0.85"],
    "inst-0.95": ["--decoder", "spec-instrument", "--decoder-arg", "alpha=0.95"],
}
SHORTLISTED = {"spec", "inst-0.6", "inst-0.7", "inst-0.85", "inst-0.95"}
# NAME@fs: the same candidate timed side by side against fast-serial (harness time --control)
DEFAULT_CONFIGS = [*(n for n in BASE if n != "fs-read-first"), *(f"{n}@fs" for n in sorted(SHORTLISTED))]
TRACE = "inst-trace:"
SMALL = "small:"  # the built-in small model, on its held-out prompts
SMALL_PROMPTS = "stdlib-heldout"
CONF = "+conf"  # spec's stop=confidence


def resolve(name: str) -> dict | None:
    """A configuration name as harness arguments: {"args", "model", "prompts", "shortlisted",
    "trace"}; model and prompts are None where --model / --prompts apply, trace where the
    configuration replays none. None for an unknown name."""
    base, fs = (name[:-3], True) if name.endswith("@fs") else (name, False)
    base, conf = (base[:-len(CONF)], True) if base.endswith(CONF) else (base, False)
    model = prompts = trace = None
    if base.startswith(SMALL):
        base, model, prompts = base[len(SMALL):], "small", SMALL_PROMPTS
    if base.startswith(TRACE) and len(base) > len(TRACE):
        trace = base[len(TRACE):]
        args = ["--decoder", "spec-instrument", "--decoder-arg", f"trace={trace}"]
    elif base in BASE:
        args = list(BASE[base])
    else:
        return None
    if conf:
        if "spec" not in args[1]:
            return None
        args += ["--decoder-arg", "stop=confidence"]
    if fs:
        args += ["--control", "fast-serial"]
    # a shortlist given on the command line belongs to --model: small's drafts keep their own
    shortlisted = model is None and (base in SHORTLISTED or base.startswith(TRACE))
    return {"args": args, "model": model, "prompts": prompts, "shortlisted": shortlisted, "trace": trace}


def run_dir(out: Path, name: str) -> Path:
    return out / name.replace("/", "_").replace(":", "_")


def run_config(name: str, args) -> int:
    cfg = resolve(name)
    out = run_dir(args.out, name)
    cmd = [sys.executable, "-m", "harness.cli", "time", *cfg["args"], "--model", cfg["model"] or args.model,
           "--prompts", cfg["prompts"] or args.prompts, "--limit", str(args.limit), "-n", str(args.max_new_tokens),
           "--legs", str(args.legs), "--out", str(out), "--force"]
    if args.shortlist and cfg["shortlisted"]:
        cmd += ["--decoder-arg", f"shortlist={args.shortlist}"]
    print("$", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd)
    if rc != 0 or args.no_audit:
        return rc
    audit = [sys.executable, "-m", "audit", "replay", str(out / "stream.jsonl")]
    print("$", " ".join(audit), flush=True)
    return subprocess.call(audit)


def row(name: str, where: Path) -> dict | None:
    audit_path, stream_path = where / "audit.json", where / "stream.jsonl"
    if not audit_path.is_file() or not stream_path.is_file():
        return None
    audit = json.loads(audit_path.read_text())
    records, _ = read_stream(stream_path)
    header, legs = records[0], [r for r in records if r.get("type") == "leg"]

    def ms_per_token(role):
        per_prompt = {}
        for r in legs:
            if r["role"] == role and r["tokens"]:
                per_prompt.setdefault(r["prompt_id"], []).append(1e3 * r["wall_s"] / len(r["tokens"]))
        return statistics.median(statistics.median(v) for v in per_prompt.values())

    cand = [r for r in legs if r["role"] == "candidate"]
    lengths = [r["stats"].get("mean_accepted_length") for r in cand]
    lengths = [x for x in lengths if x is not None]
    mem = audit.get("memory", {})
    return {
        "config": name,
        "model": (header.get("model") or {}).get("name", "?"),
        "candidate": (header.get("candidate") or {}).get("name"),
        "against": (header.get("control") or {}).get("name"),
        "by_depth": acceptance_by_depth(cand),
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


def acceptance_by_depth(legs: list[dict]) -> list[float]:
    """Over every round of the candidate's legs, per depth k: the share of rounds that drafted k
    or more drafts whose first k were all accepted (decoders.base.DecodeStats)."""
    drafted, accepted = [], []
    for leg in legs:
        st = leg.get("stats") or {}
        for k, (d, a) in enumerate(zip(st.get("drafted_by_depth") or [], st.get("accepted_by_depth") or [])):
            while len(drafted) <= k:
                drafted.append(0)
                accepted.append(0)
            drafted[k] += d
            accepted[k] += a
    return [a / d for a, d in zip(accepted, drafted) if d]


def accepted_and_exact(r: dict) -> tuple[str, str]:
    """The mean-accepted-length (with acceptance by depth) and audit cells of a row."""
    mal = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
    if r.get("by_depth"):
        mal += " (" + " ".join(f"{a:.2f}" for a in r["by_depth"]) + ")"
    return mal, ("yes" if r["exact"] else "NO") + (" (instrument)" if r["instrument"] else "")


def print_table(rows: list[dict]) -> None:
    """One line per candidate vs serial; "vs fast-serial" is the side-by-side NAME@fs run where
    there is one, else (marked ~) the ratio of the two ratios against serial, with the
    fast-serial run of the same model."""
    base = {r["model"]: r["ratio"] for r in rows if r["candidate"] == "fast-serial" and r["against"] == "serial"}
    fs_runs = [r for r in rows if r["against"] == "fast-serial"]
    side = {r["config"].removesuffix("@fs"): r["ratio"] for r in fs_runs}
    rows = [r for r in rows if r["against"] != "fast-serial"]
    gib = lambda b: "n/a" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    print("\n| config | model | GPU | control ms/tok | ms/tok | vs control | vs fast-serial (side by side; ~ = ratio of "
          "ratios) | peak GiB (ctl / cand) | mean acc. len (acceptance by depth, cum.) | exact (audit) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    timed = [r for r in rows if r["control_ms"] is not None]
    if timed:  # the control's own row: its legs pooled over every configuration's run
        ctl_ms = statistics.median(r["control_ms"] for r in timed)
        peak = max((r["control_peak"] for r in timed if r["control_peak"] is not None), default=None)
        gpus = ", ".join(sorted({r["gpu"] for r in timed}))
        models = ", ".join(sorted({r["model"] for r in timed}))
        print(f"| serial (control, {len(timed)} runs) | {models} | {gpus} | {ctl_ms:.2f} | {ctl_ms:.2f} | 1.00x | "
              f"{'-' if len(base) != 1 or None in base.values() else f'~{1 / next(iter(base.values())):.2f}x'} | "
              f"{gib(peak)} / - | - | (defines exact) |")
    for r in rows:
        fast = base.get(r["model"])
        if r["config"] in side and side[r["config"]] is not None:
            vs_fast = f"{side[r['config']]:.2f}x"
        else:
            vs_fast = "-" if fast is None or r["ratio"] is None else f"~{r['ratio'] / fast:.2f}x"
        mal, exact = accepted_and_exact(r)
        print(f"| {r['config']} | {r['model']} | {r['gpu']} | {r['control_ms']:.2f} | {r['candidate_ms']:.2f} | "
              f"{r['ratio']:.2f}x | {vs_fast} | {gib(r['control_peak'])} / {gib(r['candidate_peak'])} | {mal} | {exact} |")
    for r in fs_runs:  # the side-by-side runs themselves: their reference is fast-serial, not serial
        mal, exact = accepted_and_exact(r)
        print(f"| {r['config']} | {r['model']} | {r['gpu']} | {r['control_ms']:.2f} (fast-serial) | "
              f"{r['candidate_ms']:.2f} | - | {r['ratio']:.2f}x | {gib(r['control_peak'])} / {gib(r['candidate_peak'])} | "
              f"{mal} | {exact} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="synthetic-9b")
    ap.add_argument("--prompts", default="random-512")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=256)
    ap.add_argument("--legs", type=int, default=1)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help="comma-separated configuration names (below); default: " + ",".join(DEFAULT_CONFIGS))
    ap.add_argument("--shortlist", default=None, help="draft shortlist JSON for spec and the instruments")
    ap.add_argument("--table-only", action="store_true", help="print the table of the runs already in --out")
    ap.add_argument("--no-audit", action="store_true",
                    help="time only; audit later, e.g. every stream at once: audit replay DIR/*/stream.jsonl")
    args = ap.parse_args()
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if resolve(c) is None]
    if unknown:
        print(f"error: unknown configs {unknown}; known: {', '.join(BASE)}, {TRACE}FILE, {SMALL}NAME, "
              f"NAME{CONF} (spec and the instrument), each also as NAME@fs", file=sys.stderr)
        return 2
    if args.table_only and not args.out.is_dir():
        print(f"error: --out {args.out} is not a directory: there are no runs to tabulate", file=sys.stderr)
        return 2
    traces = {c: resolve(c)["trace"] for c in names}
    missing = [c for c, trace in traces.items() if trace and not Path(trace).is_file()]
    if missing and not args.table_only:
        print(f"error: no trace file for {missing}", file=sys.stderr)
        return 2
    failed = []
    if not args.table_only:
        for name in names:
            if run_config(name, args) not in (0, 1):  # 1 = audit findings: still tabulated
                failed.append(name)
    # every run in DIR, labelled by its directory: this call's configurations first, in their order
    order = [run_dir(args.out, n).name for n in names]
    dirs = sorted((d for d in args.out.iterdir() if d.is_dir()) if args.out.is_dir() else [],
                  key=lambda d: (order.index(d.name) if d.name in order else len(order), d.name))
    rows = [r for r in (row(d.name, d) for d in dirs) if r is not None]
    print_table(rows)
    if failed:
        print(f"failed to run: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
