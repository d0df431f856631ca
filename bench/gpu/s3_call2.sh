#!/bin/bash
# Session 3, GPU call 2, on nvidia-h200 (carry: runs). The issue-6 benchmark, part 1, after the
# drafter's catch-up forward became CUDA graphs: every configuration timed against the serial
# control (the @fs runs and the audit follow in call 3).
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
B="python bench/spec_bench.py --out runs/specbench --shortlist runs/sl.json --no-audit"
for c in inst-0.85 spec fast-serial inst-0.6; do
  rm -rf "runs/specbench/$c"
  timeout 130 $B --configs $c > $L/bench-$c.log 2>&1
done
tar -czf $OUT/runs.tgz runs/specbench
for c in inst-0.85 spec fast-serial inst-0.6; do grep -E "^median|^random" $L/bench-$c.log | tail -5; done
