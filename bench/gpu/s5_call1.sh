#!/bin/bash
# Session 5, GPU call 1 of 3 (nvidia-h200): the issue-6 table on one host. The host is identified
# (hostname, GPU UUID) in every call so the table can show its rows share one. First the exactness
# probe (the fused q/k norm now decided by its own proof, `qk_l2norm`, never run on a GPU before;
# the drafter's long catch-ups now chunked into graphs), then, only if every scenario is exact,
# three configurations against the control at 140 s each (control ~75 ms/token x 4 x 256 ~ 80 s).
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
{ hostname; nvidia-smi -L; date -u; } > $L/host.txt; cat $L/host.txt
timeout 100 python bench/exactness_probe.py --model synthetic-9b --prompt random-2 -n 160 \
    --scenarios partial,w2,partial+drafter --json $L/probe.json 2>&1 | grep -v "falling back" > $L/probe.log
grep calibration $L/probe.log | cut -c1-400; tail -7 $L/probe.log
if grep -q "| yes |" $L/probe.log && ! grep -q "| NO |" $L/probe.log; then
  B="python bench/spec_bench.py --out runs/table --shortlist bench/synthetic9b-shortlist-32k.json --no-audit"
  for c in fast-serial spec inst-0.85; do
    rm -rf runs/table/$c; timeout 140 $B --configs $c > $L/bench-$c.log 2>&1; grep "median ratio" $L/bench-$c.log; done
  tar -czf $OUT/table1.tgz runs/table
fi
