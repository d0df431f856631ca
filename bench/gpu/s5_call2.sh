#!/bin/bash
# Session 5, GPU call 2 of 3 (carry: runs, holding call 1's runs/table): alpha 0.6 and 0.95 against
# the control, then the side-by-side runs against fast-serial that decide the targets: spec with
# its random head (3 legs: the 0.97x target is within a few percent) and alpha 0.85.
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
{ hostname; nvidia-smi -L; date -u; } > $L/host.txt; cat $L/host.txt
B="python bench/spec_bench.py --out runs/table --shortlist bench/synthetic9b-shortlist-32k.json --no-audit"
for c in inst-0.6 inst-0.95; do
  rm -rf runs/table/$c; timeout 140 $B --configs $c > $L/bench-$c.log 2>&1; grep "median ratio" $L/bench-$c.log; done
rm -rf runs/table/spec@fs; timeout 130 $B --configs spec@fs --legs 3 > $L/bench-spec_at_fs.log 2>&1; grep "median ratio" $L/bench-spec_at_fs.log
rm -rf runs/table/inst-0.85@fs; timeout 75 $B --configs inst-0.85@fs > $L/bench-inst-0.85_at_fs.log 2>&1; grep "median ratio" $L/bench-inst-0.85_at_fs.log
tar -czf $OUT/table2.tgz runs/table
