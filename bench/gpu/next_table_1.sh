#!/bin/bash
# Prepared in session 4 for the next GPU session (carry: runs, for the earlier calls' run directories): the issue-6 table
# on one host in three calls. Call 1 of 3: four configurations against the control. At ~75 ms/token
# a control series of 4 x 256 tokens is ~80 s; with model build, calibration and warm-up a config
# needs ~130 s, so each gets 140 s.
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
B="python bench/spec_bench.py --out runs/table --shortlist bench/synthetic9b-shortlist-32k.json --no-audit"
for c in fast-serial spec inst-0.6 inst-0.85; do
  rm -rf runs/table/$c; timeout 140 $B --configs $c > $L/bench-$c.log 2>&1; grep "median ratio" $L/bench-$c.log; done
tar -czf $OUT/table1.tgz runs/table
