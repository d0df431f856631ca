#!/bin/bash
# Call 3 of 3 (carry: runs, with calls 1-2's runs/table unpacked): the side-by-side runs against
# fast-serial (spec with 3 legs), their audit, and the whole table.
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
B="python bench/spec_bench.py --out runs/table --shortlist runs/sl.json --no-audit"
rm -rf runs/table/spec@fs; timeout 130 $B --configs spec@fs --legs 3 > $L/bench-spec_at_fs.log 2>&1
for c in inst-0.6 inst-0.85 inst-0.95; do
  rm -rf runs/table/$c@fs; timeout 70 $B --configs $c@fs > $L/bench-${c}_at_fs.log 2>&1; done
S=""; for c in spec inst-0.6 inst-0.85 inst-0.95; do [ -f "runs/table/$c@fs/stream.jsonl" ] && S="$S runs/table/$c@fs/stream.jsonl"; done
timeout 140 python -m audit replay $S > $L/audit-fs.log 2>&1
tail -3 $L/audit-fs.log
tar -czf $OUT/table3.tgz runs/table
python bench/spec_bench.py --out runs/table --table-only 2>&1 | tail -10
