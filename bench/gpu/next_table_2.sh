#!/bin/bash
# Call 2 of 3 (carry: runs, with call 1's runs/table unpacked): alpha 0.95 and spec-naive against the
# control (spec-naive: ~80 s of control and ~175 s of its own legs), then one audit of every stream.
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
B="python bench/spec_bench.py --out runs/table --shortlist bench/synthetic9b-shortlist-32k.json --no-audit"
rm -rf runs/table/inst-0.95; timeout 140 $B --configs inst-0.95 > $L/bench-inst-0.95.log 2>&1
rm -rf runs/table/spec-naive; timeout 300 $B --configs spec-naive > $L/bench-spec-naive.log 2>&1
timeout 140 python -m audit replay runs/table/*/stream.jsonl > $L/audit.log 2>&1
tail -3 $L/audit.log
tar -czf $OUT/table2.tgz runs/table
