"""Print one markdown table of ``audit retime`` results: ``python bench/retime_table.py DIR/*/retime.json``.

Per retime.json: the stream's claimed median ratio (in-process), the verified median ratio with
its interval and score (the retime's own legs), the verdict, the GPU work the candidate left
behind its answers (charged to its legs), the memory factor, the candidate's sandbox, the
control-code check and the retime's wall time.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its scripts' shared modules

from table_inputs import load_json, parse_files, read_all  # noqa: E402


def row(path: Path) -> str:
    d = load_json(path)
    v = d.get("verified") or {}
    ci = f"[{v['ci_low']:.3f}, {v['ci_high']:.3f}]" if v.get("ci_low") is not None else "-"
    sandbox = (d.get("sandbox") or {}).get("tool") or "none"
    code = d.get("control_code") or {}
    code_s = f"{code.get('checked', '?')} files, {len(code.get('modified') or [])} modified" if code else "unchecked"
    fails = sorted({f["check"] for f in d["findings"] if f["severity"] == "fail"})
    left = sum(f.get("seconds", 0) for f in d["findings"] if f["check"] == "gpu-work-after-answer"
               and f.get("side") == "candidate")
    mem = d.get("memory") or {}
    f_mem = f"{mem['f_mem']:.3f}" if mem.get("measured") else "-"
    return (f"| {path.parent.name} | {d['candidate']['name']} | {d['claimed']['ratio']:.3f} | "
            f"{v.get('ratio', float('nan')):.3f} | {ci} | {v.get('score', 0):.3f} | {d['verdict']} "
            f"{'(' + ', '.join(fails) + ')' if fails else ''} | {left:.1f} | {f_mem} | {sandbox} | {code_s} | "
            f"{d['seconds']:.0f} |")


def main(argv: list[str]) -> int:
    rows = read_all(parse_files(__doc__, argv, "RETIME.json"), row, "an audit retime document")
    if rows is None:
        return 2
    print("| run | candidate | claimed | verified | 95% interval | verified score | verdict | GPU work left (s) | "
          "f_mem | sandbox | control code | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
