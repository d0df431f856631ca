#!/bin/bash
# Session 5, GPU call 3 of 3 (carry: runs, holding calls 1-2's runs/table): spec-naive against the
# control (~80 s of control legs and ~200 s of its own), then one audit of every stream (each
# distinct prompt replayed once for all of them), then the whole table.
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
{ hostname; nvidia-smi -L; date -u; } > $L/host.txt; cat $L/host.txt
B="python bench/spec_bench.py --out runs/table --shortlist bench/synthetic9b-shortlist-32k.json --no-audit"
rm -rf runs/table/spec-naive; timeout 300 $B --configs spec-naive > $L/bench-spec-naive.log 2>&1; grep "median ratio" $L/bench-spec-naive.log
timeout 200 python -m audit replay runs/table/*/stream.jsonl > $L/audit.log 2>&1
grep -E "^== |verdict|exact|pass" $L/audit.log | tail -30
tar -czf $OUT/table3.tgz runs/table
python bench/spec_bench.py --out runs/table --table-only 2>&1 | tail -12
