#!/bin/bash
# Session 2, GPU call 3, on nvidia-h200-x2 (carry: runs), after the hidden-size statistic stopped
# being batched (decoders/runtime/calibration.py): re-probe partial accepts, re-time every
# configuration that verifies windows, and audit the new streams together.
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
NEW="inst-0.6 inst-0.85 inst-0.95 spec@fs inst-0.6@fs inst-0.85@fs inst-0.95@fs"
for c in $NEW; do rm -rf runs/specbench/$c; done
B="python bench/spec_bench.py --out runs/specbench --shortlist runs/sl.json --no-audit"
( CUDA_VISIBLE_DEVICES=1 timeout 90 python bench/exactness_probe.py --model synthetic-9b --prompt random-1 -n 256 \
      --scenarios partial,full,w3,partial+drafter --no-instrument --json $L/probe3.json 2>&1 | grep -v "falling back" > $L/probe3.log
  CUDA_VISIBLE_DEVICES=1 timeout 180 $B --configs spec@fs,inst-0.85@fs,inst-0.6@fs,inst-0.95@fs > $L/bench_gpu1.log 2>&1 ) &
CUDA_VISIBLE_DEVICES=0 timeout 270 $B --configs inst-0.85,inst-0.6,inst-0.95 > $L/bench_gpu0.log 2>&1
wait
S=""; for c in $NEW; do [ -f runs/specbench/$c/stream.jsonl ] && S="$S runs/specbench/$c/stream.jsonl"; done
CUDA_VISIBLE_DEVICES=0 timeout 100 python -m audit replay $S > $L/audit3.log 2>&1
tar -czf $OUT/runs.tgz runs
grep "^|" $L/probe3.log | cut -c1-200; tail -2 $L/audit3.log
python bench/spec_bench.py --out runs/specbench --table-only 2>&1 | tail -8
