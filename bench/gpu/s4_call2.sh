#!/bin/bash
# Session 4, GPU call 2, on nvidia-h200 (carry: runs). After q and k are L2-normed as one tensor
# (windows up to l2norm/2 rows) and a.float() folded into the dt_bias add: the kernel profile again,
# now with the control's prefill, the runtime's and the drafter's; the partial-accept exactness probe;
# and the instrument at alpha 0.85 against the control (4 x 512 prompts, 256 new tokens, 1 leg).
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
timeout 150 python bench/profile_runtime.py --json $L/profile.json > $L/profile.log 2>&1
timeout 240 python bench/exactness_probe.py --model synthetic-9b --prompt random-1,random-3 -n 256 \
    --scenarios partial,w2,w3,partial+drafter --json $L/probe.json 2>&1 | grep -v "falling back" > $L/probe.log
if grep -q "| yes |" $L/probe.log && ! grep -q "| NO |" $L/probe.log; then
  rm -rf runs/s4/inst-0.85
  timeout 150 python bench/spec_bench.py --out runs/s4 --shortlist runs/sl.json --no-audit --configs inst-0.85 > $L/bench.log 2>&1
  tar -czf $OUT/s4.tgz runs/s4
  grep -E "ratio|median" $L/bench.log | tail -6
fi
grep -E "^calibration|^costs" $L/profile.log
tail -11 $L/profile.log
tail -10 $L/probe.log
