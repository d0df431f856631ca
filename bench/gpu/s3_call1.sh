#!/bin/bash
# Session 3, GPU call 1, on nvidia-h200 (carry: runs). After the calibration began comparing norm
# statistics in fp32 and tens of thousands of GEMM/conv elements per row count: how often each
# GEMM shape's m-row rows differ from 1-row rows; the partial-accept exactness probe on three
# prompts (with elimination where w=2 is not exact); and, only if every probe scenario is exact,
# the instrument and spec timed side by side against fast-serial, audited together.
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
timeout 120 python bench/gemm_row_probe.py --model synthetic-9b --elements 131072 --json $L/gemm_rows.json > $L/gemm_rows.log 2>&1
timeout 330 python bench/exactness_probe.py --model synthetic-9b --prompt random-1,random-2,random-3 -n 256 \
    --scenarios w2,partial,partial+drafter --eliminate --json $L/probe.json 2>&1 | grep -v "falling back" > $L/probe.log
if grep -q "^| .* | yes |" $L/probe.log && ! grep -q "| NO |" $L/probe.log; then
  for c in "inst-0.85@fs" "spec@fs"; do rm -rf "runs/specbench/$c"; done
  timeout 200 python bench/spec_bench.py --out runs/specbench --shortlist runs/sl.json --no-audit \
      --configs inst-0.85@fs,spec@fs > $L/bench.log 2>&1
  timeout 120 python -m audit replay runs/specbench/inst-0.85@fs/stream.jsonl runs/specbench/spec@fs/stream.jsonl > $L/audit.log 2>&1
  tar -czf $OUT/runs.tgz runs/specbench/inst-0.85@fs runs/specbench/spec@fs
fi
cat $L/gemm_rows.log | grep "^|"
grep "^calibration" $L/probe.log | cut -c1-600
grep "^|" $L/probe.log | cut -c1-220
tail -3 $L/audit.log 2>/dev/null
python bench/spec_bench.py --out runs/specbench --table-only 2>&1 | tail -6
