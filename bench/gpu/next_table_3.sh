#!/bin/bash
# Call 3 of 3 (carry: runs, with calls 1-2's runs/table unpacked): the side-by-side runs against
# fast-serial that decide targets (spec with 3 legs, alpha 0.85), their audit, and the whole table;
# alpha 0.6 and 0.95 against fast-serial stay ratios of ratios (add their @fs runs if time allows).
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
B="python bench/spec_bench.py --out runs/table --shortlist bench/synthetic9b-shortlist-32k.json --no-audit"
rm -rf runs/table/spec@fs; timeout 130 $B --configs spec@fs --legs 3 > $L/bench-spec_at_fs.log 2>&1
rm -rf runs/table/inst-0.85@fs; timeout 70 $B --configs inst-0.85@fs > $L/bench-inst-0.85_at_fs.log 2>&1
S=""; for c in spec inst-0.6 inst-0.85 inst-0.95; do [ -f "runs/table/$c@fs/stream.jsonl" ] && S="$S runs/table/$c@fs/stream.jsonl"; done
timeout 140 python -m audit replay $S > $L/audit-fs.log 2>&1
tail -3 $L/audit-fs.log
tar -czf $OUT/table3.tgz runs/table
python bench/spec_bench.py --out runs/table --table-only 2>&1 | tail -10
