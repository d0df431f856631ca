#!/bin/bash
# Session 4, GPU call 3, on nvidia-h200 (carry: runs). After batching the readout, fusing the q/k
# L2 norm and cutting per-layer/per-row copies: the partial-accept exactness probe on one prompt,
# then (only if exact) the issue-6 configurations that decide targets: fast-serial and the
# instrument at alpha 0.85 against the control, spec (random head, 3 legs) and the instrument side
# by side against fast-serial; one audit of all four streams; the table.
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
timeout 110 python bench/exactness_probe.py --model synthetic-9b --prompt random-2 -n 256 \
    --scenarios partial,w2,partial+drafter --json $L/probe.json 2>&1 | grep -v "falling back" > $L/probe.log
tail -6 $L/probe.log
if grep -q "| yes |" $L/probe.log && ! grep -q "| NO |" $L/probe.log; then
  B="python bench/spec_bench.py --out runs/s4 --shortlist runs/sl.json --no-audit"
  for c in fast-serial inst-0.85 inst-0.85@fs; do
    rm -rf runs/s4/$c; timeout 130 $B --configs $c > $L/bench-$c.log 2>&1; grep "median ratio" $L/bench-$c.log; done
  rm -rf runs/s4/spec@fs; timeout 120 $B --configs spec@fs --legs 3 > $L/bench-spec@fs.log 2>&1; grep "median ratio" $L/bench-spec@fs.log
  S=""; for c in fast-serial inst-0.85 inst-0.85@fs spec@fs; do [ -f runs/s4/$c/stream.jsonl ] && S="$S runs/s4/$c/stream.jsonl"; done
  timeout 150 python -m audit replay $S > $L/audit.log 2>&1
  tail -4 $L/audit.log
  tar -czf $OUT/s4.tgz runs/s4
  python bench/spec_bench.py --out runs/s4 --table-only 2>&1 | tail -6
fi
