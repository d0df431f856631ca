"""Print one markdown table of ``audit retime`` results: ``python bench/retime_table.py DIR/*/retime.json``.

Per retime.json: the stream's claimed median ratio (in-process), the verified median ratio with
its bootstrap interval and score (the retime's own legs), the verdict, the candidate's sandbox,
the control-code check and the retime's wall time.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def row(path: Path) -> str:
    d = json.loads(path.read_text())
    v = d.get("verified") or {}
    ci = f"[{v['ci_low']:.3f}, {v['ci_high']:.3f}]" if v.get("ci_low") is not None else "-"
    sandbox = (d.get("sandbox") or {}).get("tool") or "none"
    code = d.get("control_code") or {}
    code_s = f"{code.get('checked', '?')} files, {len(code.get('modified') or [])} modified" if code else "unchecked"
    fails = sorted({f["check"] for f in d["findings"] if f["severity"] == "fail"})
    return (f"| {path.parent.name} | {d['candidate']['name']} | {d['claimed']['ratio']:.3f} | "
            f"{v.get('ratio', float('nan')):.3f} | {ci} | {v.get('score', 0):.3f} | {d['verdict']} "
            f"{'(' + ', '.join(fails) + ')' if fails else ''} | {sandbox} | {code_s} | {d['seconds']:.0f} |")


def main(paths: list[str]) -> int:
    print("| run | candidate | claimed | verified | 95% interval | verified score | verdict | sandbox | control code | s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in paths:
        print(row(Path(p)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
