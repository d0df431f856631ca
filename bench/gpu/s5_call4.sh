#!/bin/bash
# Session 5, GPU call 4 (no carry needed), on whatever host is warm (calls 2-3 ran on a second host
# whose control is faster than call 1's): fast-serial against the control on this host, so the rows
# timed here have a same-host baseline; its audit; then one issue-7 retrain variant (dropout 0.2,
# weight decay 0.3), chosen beforehand as the strongest regularisation of the three prepared.
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
{ hostname; nvidia-smi -L; date -u; } > $L/host.txt; cat $L/host.txt
B="python bench/spec_bench.py --out runs/host2 --no-audit"
timeout 140 $B --configs fast-serial > $L/bench-fast-serial.log 2>&1; grep "median ratio" $L/bench-fast-serial.log
timeout 100 python -m audit replay runs/host2/fast-serial/stream.jsonl > $L/audit.log 2>&1; grep verdict $L/audit.log
tar -czf $OUT/host2.tgz runs/host2
timeout 170 python -m fixtures.train_small --out $OUT/v2 --minutes 2.5 --dropout 0.2 --weight-decay 0.3 > $L/v2.log 2>&1
tail -5 $L/v2.log
