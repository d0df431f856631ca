#!/bin/bash
# Session 3, GPU call 3, on nvidia-h200 (carry: runs). The issue-6 benchmark, part 2: alpha 0.95
# against the control, every shortlisted configuration side by side against fast-serial, then one
# audit of every stream of calls 2 and 3 (each distinct prompt replayed once), and the table.
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
B="python bench/spec_bench.py --out runs/specbench --shortlist runs/sl.json --no-audit"
for c in inst-0.95 inst-0.85@fs spec@fs inst-0.6@fs inst-0.95@fs; do
  rm -rf "runs/specbench/$c"
  timeout 130 $B --configs $c > $L/bench-$c.log 2>&1
done
S=""; for c in fast-serial spec inst-0.6 inst-0.85 inst-0.95 spec@fs inst-0.6@fs inst-0.85@fs inst-0.95@fs; do
  [ -f runs/specbench/$c/stream.jsonl ] && S="$S runs/specbench/$c/stream.jsonl"; done
timeout 200 python -m audit replay $S > $L/audit.log 2>&1
tar -czf $OUT/runs.tgz runs/specbench
tail -4 $L/audit.log
python bench/spec_bench.py --out runs/specbench --table-only 2>&1 | tail -9
