"""Print one markdown table of a sampled exactness sweep: ``python bench/sampling_exact_table.py DIR/*/stream.jsonl``.

Per stream (``harness time --sampling``, then ``audit replay``): the model, the header's sampler,
the candidate, whether the audit found every token exact (audit.json beside the stream), the
candidate's acceptance summed over its legs (accepted / drafted, and tokens per verification
round; "-" for a decoder that drafts nothing) and the median speed ratio the audit recomputed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its scripts' shared modules

from table_inputs import parse_files, read_all  # noqa: E402


def describe(sampler: dict | None) -> str:
    if not sampler or sampler.get("temperature", 0) == 0:
        return "greedy"
    parts = [f"T={sampler['temperature']:g}"]
    parts += [f"top_k={sampler['top_k']}"] if sampler.get("top_k") else []
    parts += [f"top_p={sampler['top_p']:g}"] if sampler.get("top_p", 1) < 1 else []
    parts += [f"min_p={sampler['min_p']:g}"] if sampler.get("min_p", 0) > 0 else []
    return ",".join(parts + [f"seed={sampler.get('seed', 0)}"])


def row(path: Path) -> str:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    header = records[0]
    legs = [r for r in records if r.get("type") == "leg" and r["role"] == "candidate"]
    drafted = sum(r["stats"].get("drafted", 0) for r in legs)
    accepted = sum(r["stats"].get("accepted", 0) for r in legs)
    rounds = sum(sum(r["stats"].get("accept_hist", {}).values()) for r in legs)
    acceptance = (f"{accepted / drafted:.2f} ({(accepted + rounds) / rounds:.2f} tok/round)"
                  if drafted and rounds else "-")
    audit_path = path.parent / "audit.json"
    audit = json.loads(audit_path.read_text()) if audit_path.is_file() else None
    exact = "not audited" if audit is None else ("yes" if audit["exact"] else "NO")
    ratio = f"{audit['median_ratio']:.3f}" if audit and audit.get("median_ratio") is not None else "-"
    cand = header["candidate"]
    args = ",".join(f"{k}={v}" for k, v in sorted((cand.get("args") or {}).items()))
    return (f"| {header['model'].get('name', '?')} | {describe(header.get('sampler'))} | "
            f"{cand['name']}{f' ({args})' if args else ''} | {exact} | {acceptance} | {ratio} |")


def main(argv: list[str]) -> int:
    rows = read_all(sorted(parse_files(__doc__, argv, "STREAM.jsonl")), row, "a harness stream")
    if rows is None:
        return 2
    print("| model | sampler | decoder | exact | acceptance | ratio |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
