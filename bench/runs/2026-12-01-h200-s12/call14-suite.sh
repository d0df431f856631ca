#!/bin/bash
# The whole suite on the H200 in two pytest processes run side by side (one process outlives a
# 10-minute call); test_cuda runs in the same process as, and before, test_retime.
set -u
python -m pip install -q --no-deps --no-index .whl/*.whl >/dev/null 2>&1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
L=$OUT; { hostname; nvidia-smi -L; date -u; nproc; } > $L/host.txt
B="tests/test_cuda.py tests/test_prefill.py tests/test_retime.py tests/test_runtime.py tests/test_serial.py tests/test_shortlist.py tests/test_spec.py tests/test_timing_integrity.py tests/test_trace.py tests/test_train.py"
A=$(ls tests/test_*.py | grep -v -x -F "$(echo $B | tr ' ' '\n')" | tr '\n' ' ')
echo "A: $A" > $L/parts.txt; echo "B: $B" >> $L/parts.txt
ls tests/test_*.py | wc -l >> $L/parts.txt; echo $A $B | wc -w >> $L/parts.txt
s=$SECONDS
run() { local name=$1; shift; timeout 570 python -m pytest -q -rfEs --tb=long -p no:cacheprovider --durations=30 "$@" > $L/suite-$name.log 2>&1; echo "$name rc=$? $((SECONDS - s)) s" >> $L/steps.txt; }
run A $A & run B $B & wait
cat $L/parts.txt $L/steps.txt; for p in A B; do grep -n "^FAILED\|^ERROR\| passed\| failed" $L/suite-$p.log | tail -5; done
