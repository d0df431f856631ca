#!/bin/bash
# Session 4, GPU call 1, on nvidia-h200. Kernel profile of step / windows / draft / prefill after
# the recurrence's readout became one batched reduction per window (calibrated: `readout`) and
# per-row norm statistics stopped being concatenated; then the partial-accept exactness probe.
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
timeout 200 python bench/profile_runtime.py --json $L/profile.json > $L/profile.log 2>&1
timeout 300 python bench/exactness_probe.py --model synthetic-9b --prompt random-1,random-2 -n 256 \
    --scenarios partial,w2,partial+drafter --json $L/probe.json 2>&1 | grep -v "falling back" > $L/probe.log
grep -E "^calibration|^costs" $L/profile.log
tail -9 $L/profile.log
tail -12 $L/probe.log
