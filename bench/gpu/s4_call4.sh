#!/bin/bash
# Session 4, GPU call 4, on nvidia-h200 (carry: runs, with call 3's four runs in runs/s4). The
# rest of the issue-6 table on the same code: spec (random head) and the instrument at alpha 0.6
# and 0.95 against the control; one audit of the three streams; the whole table (call 3's rows
# included). spec-naive is not re-run (its code is unchanged since session 2's run).
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
B="python bench/spec_bench.py --out runs/s4 --shortlist runs/sl.json --no-audit"
for c in spec inst-0.6 inst-0.95; do
  rm -rf runs/s4/$c; timeout 125 $B --configs $c > $L/bench-$c.log 2>&1; grep "median ratio" $L/bench-$c.log; done
S=""; for c in spec inst-0.6 inst-0.95; do [ -f runs/s4/$c/stream.jsonl ] && S="$S runs/s4/$c/stream.jsonl"; done
timeout 110 python -m audit replay $S > $L/audit.log 2>&1
tail -2 $L/audit.log
tar -czf $OUT/s4.tgz runs/s4/spec runs/s4/inst-0.6 runs/s4/inst-0.95
python bench/spec_bench.py --out runs/s4 --table-only 2>&1 | tail -9
